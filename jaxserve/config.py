"""Model and engine configuration: dataclasses, HF `config.json` parsing, YAML files in `configs/`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # llama3: factor, low/high_freq_factor, original_max_position_embeddings
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    sliding_window: int | None = None      # Mistral: keys with pos > query pos - window
    attention_bias: bool = False           # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size + head


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a HF `config.json` dict (transformers 4.x and 5.x field names)."""
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), cfg.get("model_type"))
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    return ModelConfig(
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(rope_theta),
        rope_scaling=rope if rope_type == "llama3" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=window,
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg.get("eos_token_id")))


@dataclass(slots=True)
class EngineConfig:
    """Knobs of the engine; defaults suit the embedded model on CPU. See configs/*.yaml."""
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    min_prefill_chunk: int = 32            # prefill gets max(min_prefill_chunk, budget - decode tokens)
    block_size: int = 16
    num_blocks: int | None = None          # None: sized from free memory
    memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    token_buckets: tuple[int, ...] | None = None   # None: powers of two from 16 to max_num_batched_tokens
    seq_buckets: tuple[int, ...] | None = None     # None: powers of two from 8 to max_num_seqs
    seed: int = 0
    async_scheduling: bool = True          # launch step N+1 before step N's samples reach the host
    # models/attention.py resolves both once per engine (AttentionKernels)
    decode_attention: str = "auto"         # decode-only steps: "auto" (the Pallas decode-only launch), "cuda"
    # prefill rows on GPU: "triton", or "mosaic" (the Hopper kernel: faster on long prompts, its compile time
    # inside a 32-layer step not yet measured, so off by default; benchmarks/NOTES_attention.md)
    prefill_attention: str = "triton"
    compile_cache_dir: str | None = "~/.cache/jaxserve/xla"
    precompile: bool = True
    precompile_sampler_modes: tuple[str, ...] = ("greedy", "sample", "sort")   # others compile on first use


@dataclass(slots=True)
class RunConfig:
    """A YAML file in configs/: which model, which dtype, engine knobs."""
    model: str = "smollm2-135m-instruct"
    dtype: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    random_model: dict | None = None       # HF-style config for random weights (benchmarks)


def load_run_config(path: str | Path) -> RunConfig:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = raw.pop("engine", {}) or {}
    unknown = set(engine) - known
    if unknown:
        raise ValueError(f"{path}: unknown engine keys {sorted(unknown)}; known: {sorted(known)}")
    for key in ("token_buckets", "seq_buckets", "precompile_sampler_modes"):
        if engine.get(key) is not None:
            engine[key] = tuple(engine[key])
    return RunConfig(engine=EngineConfig(**engine), **raw)
