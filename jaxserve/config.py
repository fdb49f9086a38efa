"""Model and engine configuration: dataclasses, HF `config.json` parsing, YAML files in `configs/`."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}


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
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the router's top num_experts_per_tok of
    # num_experts experts of moe_intermediate_size, weighed by their softmax probabilities (renormalised over the
    # chosen when norm_topk_prob); dense_layers keep a dense MLP of intermediate_size. num_experts 0: dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    def __hash__(self):   # a static part of the jitted layer (models/llama.run_layer): rope_scaling is a dict
        return hash(tuple(tuple(sorted((self.rope_scaling or {}).items())) if f.name == "rope_scaling"
                          else getattr(self, f.name) for f in dataclasses.fields(self)))

    def __post_init__(self):
        for name in ("eos_token_ids", "dense_layers"):   # JSON (a saved config) gives lists: hashed as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in MODEL_SIZES:
            _require_positive_int(name, getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.sliding_window is not None:
            _require_positive_int("sliding_window", self.sliding_window)
        if not all(map(_is_int, self.eos_token_ids)):
            raise ValueError(f"eos_token_ids must be ints, got {list(self.eos_token_ids)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                _require_positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                                 f"{self.num_experts}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlps = sum(self.mlp_params(i) for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * attn + mlps + self.vocab_size * self.hidden_size + head

    def mlp_params(self, layer: int, experts: float | None = None) -> float:
        """Layer's MLP parameters: all of them, or in a mixture of experts its router and `experts` experts (those
        a step's tokens are routed to)."""
        if not self.is_moe_layer(layer):
            return 3 * self.hidden_size * self.intermediate_size
        experts = self.num_experts if experts is None else experts
        return self.hidden_size * (self.num_experts + 3 * experts * self.moe_intermediate_size)

    def expected_experts(self, rows: int) -> float:
        """Distinct experts a layer's `rows` tokens are routed to, if the router spreads choices uniformly."""
        return self.num_experts * (1 - (1 - self.num_experts_per_tok / self.num_experts) ** rows)


# The sizes a model is built from: each must be a positive int (ModelConfig names, then config.json names).
MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim", "max_position_embeddings")
HF_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HF_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")   # null or absent: derived


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)   # JSON's true is no size


def _require_positive_int(name: str, value) -> None:
    if not (_is_int(value) and value > 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_hf_sizes(cfg) -> None:
    """Checked under their config.json names, before head_dim is derived from them."""
    if not isinstance(cfg, dict):
        raise ValueError(f"must be a JSON object, got a {type(cfg).__name__}")
    if missing := [name for name in HF_REQUIRED_SIZES if name not in cfg]:
        raise ValueError(f"missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    for name in HF_REQUIRED_SIZES + tuple(n for n in HF_OPTIONAL_SIZES if cfg.get(n) is not None):
        _require_positive_int(name, cfg[name])


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _moe_fields(cfg: dict, arch: str) -> dict:
    """ModelConfig's MoE fields from config.json: Mixtral (num_local_experts, experts of intermediate_size, top-k
    always renormalised) and Qwen3-MoE (num_experts, or num_local_experts as transformers 5 writes it;
    moe_intermediate_size; norm_topk_prob; dense MLPs in mlp_only_layers and off the decoder_sparse_step)."""
    if arch == "mixtral":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if arch != "qwen3_moe":
        return {}
    step, layers = cfg.get("decoder_sparse_step") or 1, cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=tuple(sorted(dense)))


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a HF `config.json` dict (transformers 4.x and 5.x field names); a malformed
    one is a ValueError naming the field."""
    _check_hf_sizes(cfg)
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), cfg.get("model_type"))
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "mixtral")) else None
    return ModelConfig(**_moe_fields(cfg, arch),
        arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(rope_theta),
        rope_scaling=rope if rope_type == "llama3" else None,
        max_position_embeddings=cfg.get("max_position_embeddings") or 8192,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_window=window,
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg.get("eos_token_id")))


# The names a knob may take (models/attention.py and engine/sampler.py give them meaning).
DECODE_ATTENTION = ("auto", "triton", "mosaic", "cuda")
PREFILL_ATTENTION = ("auto", "triton", "mosaic")
CASCADE_ATTENTION = ("auto", "on", "off")
SAMPLER_MODES = ("greedy", "sample", "filter")   # cheapest first: argmax; + penalties, temperature, min-p; + top-k/p
KV_CACHE_DTYPES = ("auto", "fp8")   # cache/kv_cache.py: auto keeps the model's dtype; fp8 is e4m3 with scales
# fp8: weights of the linear layers in e4m3, per output channel scales (models/fp8.py); gguf: a GGUF file's Q4_1 /
# Q8_0 blocks kept as stored (models/gguf_blocks.py; None does so on one CPU device); float: the model dtype
QUANTIZATIONS = (None, "fp8", "gguf", "float")
KV_BACKENDS = ("paged", "vattention")   # vattention: jaxserve/cache/vattention.py
VATTENTION_KERNELS = ("contiguous", "identity")   # models/attention.py: slots, or identity block tables
GENERATION_CONFIGS = ("auto", "vllm")   # requests' sampling defaults: the model's generation_config, or vLLM's
SPECULATIVE_METHODS = ("ngram", "draft", "eagle3")   # engine/speculation.py
MODEL_DRAFTERS = ("draft", "eagle3")   # the methods whose drafts come from a model: speculative_config.model


@dataclass(frozen=True, slots=True)
class Check:
    """A rule one knob must meet on its own, and how the error words it ("engine config: NAME RULE, got V")."""
    ok: Callable[[object], bool]
    rule: str


def one_of(choices: tuple[str, ...]) -> Check:
    return Check(lambda v: v in choices, f"must be one of {choices}")


def _is_ladder(v) -> bool:
    return v is None or (isinstance(v, tuple) and len(v) > 0 and all(map(_is_int, v)) and v[0] > 0
                         and all(a < b for a, b in zip(v, v[1:])))


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "must be a positive int")
OPTIONAL_POSITIVE_INT = Check(lambda v: v is None or (_is_int(v) and v > 0), "must be a positive int or null")
INT = Check(_is_int, "must be an int")
NON_NEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "must be an int >= 0")
BOOL = Check(lambda v: isinstance(v, bool), "must be true or false")
OPTIONAL_PATH = Check(lambda v: v is None or isinstance(v, str), "must be a path or null")
BUCKETS = Check(_is_ladder, "must be null or a strictly increasing list of positive ints")
BLOCK_COUNT = Check(lambda v: v is None or (_is_int(v) and v >= 2),
                    "must be an int >= 2 (block 0 is the null block) or null")
FRACTION_UP_TO_1 = Check(lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "must be in (0, 1]")
FRACTION_BELOW_1 = Check(lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "must be in [0, 1)")

GROUPS = ("scheduler", "cache", "compilation", "parallel", "admission", "sampling", "vattention", "speculative")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculation.py), vLLM's `speculative_config`: a proposer drafts up to
    num_speculative_tokens tokens per decoding sequence, which one step of the model verifies exactly."""
    method: str = "ngram"
    # draft: the draft model (a name or path, as the model's): any model with the model's tokenizer, its KV in
    # more layers of the same paged cache (engine/drafter.py); eagle3: an EAGLE-3 head trained for the model
    # (models/eagle3.py), a directory in the published layout
    model: str | None = None
    num_speculative_tokens: int = 4
    # ngram: the longest suffix of prompt_lookup_min..max tokens that occurred before proposes what followed it
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # the most decoding sequences a speculative step holds (its graphs compile up to this seq bucket); up to it,
    # each bucket speculates when that measured faster (engine/speculation.py). Big batches gain little: a step of
    # 256 rows x 5 tokens costs 2.5x a decode step of the 8B shape on an H100 (benchmarks/NOTES_speculative.md)
    max_num_seqs: int = 8

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_num_seqs"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"speculative_config.{name} must be a positive int, got {getattr(self, name)!r}")
        if (self.method in MODEL_DRAFTERS) != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model of methods 'draft' and 'eagle3' (and "
                             f"only theirs): got method {self.method!r} with model {self.model!r}")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config.model must be a model name or path, got {self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @property
    def width(self) -> int:
        """Tokens a verifying row computes: its last known token and the drafts."""
        return self.num_speculative_tokens + 1


def speculative_config(value) -> SpeculativeConfig | None:
    """A SpeculativeConfig from the config file's mapping (its keys checked), or as given."""
    if not isinstance(value, dict):
        return value
    if unknown := set(value) - {f.name for f in dataclasses.fields(SpeculativeConfig)}:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: "
                         f"{[f.name for f in dataclasses.fields(SpeculativeConfig)]}")
    return SpeculativeConfig(**value)


@dataclass(frozen=True, slots=True)
class KnobSpec:
    """What an EngineConfig field declares about itself. graphs: the compiled graphs may depend on it, so it is
    in graph_knobs, the executable cache's fingerprint (False only where no graph reads it: a False on a knob a
    graph does read lets a warm start load executables built for another value). flag: a `--kebab-name` int
    option of `jaxserve serve` (cli.py registers them all alike). check: the rule it meets on its own; rules
    between knobs are in check_engine_config."""
    group: str
    graphs: bool
    flag: bool
    check: Check | None


def knob(default, *, group: str, graphs: bool = True, flag: bool = False, check: Check | None = None):
    """An EngineConfig field with its KnobSpec (read back through KNOBS)."""
    if group not in GROUPS:
        raise ValueError(f"knob group {group!r} is not one of {GROUPS}")
    return field(default=default, metadata={"knob": KnobSpec(group, graphs, flag, check)})


@dataclass(slots=True)
class EngineConfig:
    """Knobs of the engine; defaults suit the embedded model on CPU. See configs/*.yaml (flat under `engine:`).
    Checked whole at construction: a bad knob is a ValueError naming it. Each field declares its KnobSpec."""
    # Scheduler: what one step holds, and how its token budget is split
    # None: the model's context length (the block tables' width), capped to what the KV cache holds per sequence
    # (llm_engine.fit_to_kv_pool). Every command's --max-model-len (cli.add_model_args)
    max_model_len: int | None = knob(None, group="scheduler", check=OPTIONAL_POSITIVE_INT)
    max_num_seqs: int = knob(32, group="scheduler", flag=True, check=POSITIVE_INT)
    max_num_batched_tokens: int = knob(256, group="scheduler", flag=True, check=POSITIVE_INT)
    # prefill gets max(min_prefill_chunk, budget - decode tokens)
    min_prefill_chunk: int = knob(32, group="scheduler", graphs=False, flag=True, check=POSITIVE_INT)
    # launch step N+1 before step N's samples reach the host
    async_scheduling: bool = knob(True, group="scheduler", check=BOOL)
    seed: int = knob(0, group="scheduler", check=INT)   # draws the seed of each request that brings none

    # Cache: the KV cache's blocks and how much of the device they take
    block_size: int = knob(16, group="cache", check=POSITIVE_INT)
    # None: sized from free memory. Graphs that take the cache carry its size in their keys (step_graphs.GraphKey)
    num_blocks: int | None = knob(None, group="cache", graphs=False, flag=True, check=BLOCK_COUNT)
    memory_fraction: float = knob(0.9, group="cache", graphs=False, check=FRACTION_UP_TO_1)
    enable_prefix_caching: bool = knob(True, group="cache", check=BOOL)
    watermark: float = knob(0.01, group="cache", graphs=False, check=FRACTION_BELOW_1)   # blocks kept free
    # "paged", or "vattention": each sequence's KV in one contiguous row of a virtual range whose pages are mapped
    # on demand (no prefix caching)
    kv_backend: str = knob("paged", group="cache", check=one_of(KV_BACKENDS))
    # "fp8": K and V stored in float8 e4m3 with a scale per layer and kv head (calibrated at start unless the
    # checkpoint brings them): twice the tokens in the same memory, half the bytes a decode step reads
    kv_cache_dtype: str = knob("auto", group="cache", check=one_of(KV_CACHE_DTYPES))

    # Compilation: which graphs exist (the bucket shapes, the attention kernels) and where executables persist
    # None: powers of two from 16 to max_num_batched_tokens, and from 8 to max_num_seqs
    token_buckets: tuple[int, ...] | None = knob(None, group="compilation", check=BUCKETS)
    seq_buckets: tuple[int, ...] | None = knob(None, group="compilation", check=BUCKETS)
    # models/attention.py resolves both once per engine (AttentionKernels).
    # decode-only steps: "auto" (on sm_90 no Triton kernel: the Mosaic GPU decode, and the custom call's tensor-core
    # kernel for FP8 caches and for 256+ sequence slots, mixed steps' decodes too; elsewhere the Pallas (Triton)
    # decode-only launch), "triton", "mosaic" (the Hopper kernel), "cuda" (the custom call)
    decode_attention: str = knob("auto", group="compilation", check=one_of(DECODE_ATTENTION))
    # prefill rows on GPU: "auto" (on sm_90 the Mosaic GPU kernel for the shapes and dtypes it serves: 2.2x Triton's
    # on a long prompt, 1.27x over an FP8 cache; a cold start traces its kernels ~22 s longer; else Triton),
    # "triton", or "mosaic" (the Hopper kernel, an error where it cannot serve)
    prefill_attention: str = knob("auto", group="compilation", check=one_of(PREFILL_ATTENTION))
    # decode-only steps whose sequences share leading KV blocks (a system prompt, n > 1) read each shared prefix once
    # per group (cascade attention): "auto" where the Pallas decode kernel runs, for groups that save enough reads
    # (step_graphs.CASCADE_MIN_SAVED_KEYS); "on": every group sharing a block, on any platform; "off"
    cascade_attention: str = knob("auto", group="compilation", check=one_of(CASCADE_ATTENTION))
    # what a warm start reuses: the engine's executables, XLA's compilation cache (GPU), GGUF models as loaded
    compile_cache_dir: str | None = knob("~/.cache/jaxserve/xla", group="compilation", graphs=False,
                                         check=OPTIONAL_PATH)
    precompile: bool = knob(True, group="compilation", graphs=False, check=BOOL)

    # Parallel: devices the model is split over, Megatron-style (models/sharding.py)
    tensor_parallel_size: int = knob(1, group="parallel", check=POSITIVE_INT)

    # Admission: waiting requests / their prompt tokens beyond which new ones get AdmissionError (retry later);
    # None: unbounded, as batch generation wants
    max_queued_requests: int | None = knob(None, group="admission", graphs=False, flag=True,
                                           check=OPTIONAL_POSITIVE_INT)
    max_queued_tokens: int | None = knob(None, group="admission", graphs=False, flag=True,
                                         check=OPTIONAL_POSITIVE_INT)

    # Sampling: what a request leaves unset takes "auto": the model's generation_config (HF generation_config.json,
    # GGUF general.sampling.*), else vLLM's defaults; "vllm": vLLM's always
    generation_config: str = knob("auto", group="sampling", graphs=False, check=one_of(GENERATION_CONFIGS))

    # vAttention: read only with kv_backend: vattention
    # 0 maps the whole page pool at start, spread over the slots (eager allocation: no maps in the steps until a
    # sequence outgrows its share); > 0 maps on demand, plus this many tokens ahead on a thread
    vattention_lookahead_tokens: int = knob(0, group="vattention", graphs=False, check=NON_NEGATIVE_INT)
    # "contiguous" (the kernels address each row from its slot id; a step carries one slot per sequence, no block
    # table) or "identity" (the paged kernels over identity block tables)
    vattention_kernels: str = knob("contiguous", group="vattention", check=one_of(VATTENTION_KERNELS))

    # Speculative decoding: None off; a SpeculativeConfig (a mapping in the config file) on
    speculative_config: SpeculativeConfig | None = knob(
        None, group="speculative", check=Check(lambda v: v is None or isinstance(v, SpeculativeConfig),
                                               "must be a mapping (method, num_speculative_tokens, ...) or null"))

    def __post_init__(self):
        for name in ("token_buckets", "seq_buckets"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        self.speculative_config = speculative_config(self.speculative_config)
        if isinstance(self.cascade_attention, bool):   # YAML 1.1 (PyYAML) reads a bare on / off as a boolean
            self.cascade_attention = "on" if self.cascade_attention else "off"
        check_engine_config(self)


KNOBS: dict[str, KnobSpec] = {f.name: f.metadata["knob"] for f in dataclasses.fields(EngineConfig)}


def graph_knobs(cfg: EngineConfig) -> dict:
    """The engine knobs the compiled graphs may depend on: what the executable cache's fingerprint covers."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if KNOBS[k].graphs}


def engine_flags() -> tuple[str, ...]:
    """The knobs that are int options of `jaxserve serve` (--max-num-seqs, ...), in field order."""
    return tuple(name for name, spec in KNOBS.items() if spec.flag)


def check_engine_config(c: EngineConfig) -> None:
    """Each knob's own check (KnobSpec.check), then the rules between knobs."""
    def need(ok: bool, name: str, rule: str):
        if not ok:
            raise ValueError(f"engine config: {name} {rule}, got {getattr(c, name)!r}")

    for name, spec in KNOBS.items():
        if spec.check is not None:
            need(spec.check.ok(getattr(c, name)), name, spec.check.rule)
    if c.kv_backend == "vattention":
        need(not c.enable_prefix_caching, "enable_prefix_caching", "must be false with kv_backend: vattention "
             "(its pages are per sequence, not shared): set enable_prefix_caching: false")
        need(c.tensor_parallel_size == 1, "tensor_parallel_size", "must be 1 with kv_backend: vattention (the "
             "per-device ranges are not yet combined into one sharded cache)")
    if c.speculative_config is not None:
        need(c.kv_backend == "paged", "kv_backend", "must be paged with speculative_config (drafts take lookahead "
             "slots in the block tables)")
    need(c.max_num_seqs + c.min_prefill_chunk <= c.max_num_batched_tokens, "max_num_batched_tokens",
         f"must be >= max_num_seqs ({c.max_num_seqs}) + min_prefill_chunk ({c.min_prefill_chunk}) so that decodes "
         "never starve prefill")
    for name, high in (("token_buckets", c.max_num_batched_tokens), ("seq_buckets", c.max_num_seqs)):
        ladder = getattr(c, name)
        need(ladder is None or ladder[-1] >= high, name, f"must reach {high} (its largest bucket serves the "
             f"{'whole token budget' if name == 'token_buckets' else 'most sequences a step can hold'})")


@dataclass(slots=True)
class RunConfig:
    """A YAML file in configs/: which model, which dtype, engine knobs."""
    model: str = "smollm2-135m-instruct"
    dtype: str | None = None
    quantization: str | None = None        # QUANTIZATIONS: None, "fp8", "gguf", "float" (loader.load_model)
    engine: EngineConfig = field(default_factory=EngineConfig)
    random_model: dict | None = None       # HF-style config for random weights (benchmarks)


def load_run_config(path: str | Path) -> RunConfig:
    """A YAML run config; a missing or malformed file, an unknown key or a bad knob is a ValueError naming it."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    raw = {} if raw is None else raw
    engine = raw.pop("engine", None) or {} if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(engine, dict):
        raise ValueError(f"config {path}: must be a mapping with keys {sorted(RUN_KEYS)}")
    for keys, known, where in ((raw, RUN_KEYS, ""), (engine, ENGINE_KEYS, "engine ")):
        if unknown := set(keys) - known:
            raise ValueError(f"config {path}: unknown {where}keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return RunConfig(engine=EngineConfig(**engine), **raw)
    except ValueError as e:
        raise ValueError(f"config {path}: {e}") from None


ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
RUN_KEYS = {f.name for f in dataclasses.fields(RunConfig)}
