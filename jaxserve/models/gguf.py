"""GGUF files: config, tokenizer, chat template and recommended sampling from the metadata; tensors read
(memory-mapped) and dequantized by the `gguf` package, the llama.cpp project's own reader, so every type it
dequantizes loads: F32, F16, BF16, Q4_0..Q8_0, the K-quants Q2_K..Q6_K that Q4_K_M-style files mix, IQ*, TQ*,
MXFP4. Tensors are renamed to HF names, so one weight mapping serves both formats. Linear weights in a block
format the CPU kernel reads (custom_calls.gguf_matmul) can instead stay as stored (gguf_blocks)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from custom_calls.gguf_matmul import BLOCK_TYPES
from jaxserve.config import ModelConfig
from jaxserve.models.errors import ModelLoadError, blamed_on
from jaxserve.models.gguf_blocks import GgufBlocks

GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
TENSOR_NAMES = {  # GGUF per-layer suffix -> HF name
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    # a mixture of experts: the router, and every expert's projection stacked [E, out, in], as the model holds them
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj", "ffn_down_exps.weight": "mlp.experts.down_proj",
}
ROPE_PERMUTED = ("llama", "mistral", "mixtral")   # llama.cpp's converter interleaves these archs' q/k rows
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# llama.cpp's recommended-sampling keys (newer converters copy them from generation_config.json) -> SamplingParams
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def open_gguf(path: Path):
    import gguf

    class Reader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map: every slice of a np.memmap runs a Python
        __array_finalize__, and the reader slices ~150K times for a 49K-token vocabulary (3.5x slower)."""
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = np.asarray(mapped)

    try:
        return Reader(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct errors on corrupt files
        raise ModelLoadError(path, f"not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unknown architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    p = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    required = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")
    missing = [k for k in required if p(k) is None]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if p("vocab_size") is None and tokens is None:
        missing.append("vocab_size")
    if missing:
        raise ModelLoadError(path, f"GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    heads = p("attention.head_count")
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    moe = gguf_moe_fields(p, names)
    with blamed_on(path):   # ModelConfig names a bad size; head_dim is derived only if there are heads
        return ModelConfig(
            arch="mixtral" if arch == "llama" and moe else GGUF_ARCHS[arch],
            vocab_size=p("vocab_size") or len(tokens.data),
            hidden_size=p("embedding_length"), intermediate_size=p("feed_forward_length"),
            num_layers=p("block_count"), num_heads=heads, num_kv_heads=p("attention.head_count_kv", heads),
            head_dim=p("attention.key_length") or (p("embedding_length") // heads if heads else None),
            rms_norm_eps=p("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=p("rope.freq_base", 10000.0),
            max_position_embeddings=p("context_length", 8192), tie_word_embeddings="output.weight" not in names,
            sliding_window=p("attention.sliding_window"), attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names, bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),), **moe)


def gguf_moe_fields(p, names) -> dict:
    """ModelConfig's mixture-of-experts fields from llama.cpp's keys: Mixtral is a "llama" file with experts (of
    feed_forward_length, top-k renormalised), Qwen3-MoE "qwen3moe" (expert_feed_forward_length; renormalised unless
    expert_weights_norm says not); layers without a router keep a dense MLP."""
    if not p("expert_count"):
        return {}
    layers = p("block_count")
    return dict(num_experts=p("expert_count"), num_experts_per_tok=p("expert_used_count"),
                moe_intermediate_size=p("expert_feed_forward_length") or p("feed_forward_length"),
                norm_topk_prob=bool(p("expert_weights_norm", True)),
                dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names))


def gguf_sampling(reader) -> dict:
    """The file's recommended sampling under SamplingParams' names; a float32 value as its shortest decimal (0.9,
    not 0.8999999761581421), as the model's publisher wrote it."""
    values = {name: _field(reader, key) for key, name in SAMPLING_KEYS.items()}
    return {name: float(str(np.float32(v))) if isinstance(v, float) else v for name, v in values.items()
            if v is not None}


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rope; HF uses rotate-half. Undo the permutation."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and parts[2] in TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{TENSOR_NAMES[parts[2]]}"
    return None


def _dequantized(tensor, path: Path) -> np.ndarray:
    """A GGUF tensor as float32 in row-major (HF) order."""
    import gguf
    try:
        with np.errstate(invalid="ignore", over="ignore"):   # check_finite names a NaN/Inf tensor once, later
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:   # how gguf.quants refuses a type (integer tensors, types newer than it)
        raise ModelLoadError(path, f"tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, "
                                   "which the gguf package cannot dequantize") from None
    return np.asarray(w, np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


DENSE_LINEARS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")


def gguf_blocks(reader) -> GgufBlocks | None:
    """The block types a model of this file keeps as stored: the decoder's linear weights when all are of one type
    the CPU kernel reads, and then the embedding and LM head each when theirs is; None when the linears are not."""
    types = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            types[name] = t.tensor_type.name
    linear = {kind for name, kind in types.items() if name.endswith(DENSE_LINEARS)}
    if len(linear) != 1 or (kind := linear.pop()) not in BLOCK_TYPES:
        return None
    kept = lambda name: types.get(name) if types.get(name) in BLOCK_TYPES else None  # noqa: E731
    return GgufBlocks(kind, kept("model.embed_tokens.weight"), kept("lm_head.weight"))


def kept_as_blocks(name: str, blocks: GgufBlocks | None) -> bool:
    if blocks is None:
        return False
    return name.endswith(DENSE_LINEARS) or (name == "model.embed_tokens.weight" and blocks.embedding is not None) \
        or (name == "lm_head.weight" and blocks.lm_head is not None)


def gguf_tensors(reader, cfg: ModelConfig, path: Path, blocks: GgufBlocks | None = None):
    """Yield (hf_name, array in HF layout) for every tensor the model uses: float32, dequantized as it goes, or the
    stored blocks [out, in / 32 * bytes] (uint8) of those `blocks` keeps."""
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = np.asarray(t.data) if kept_as_blocks(name, blocks) else _dequantized(t, path)
        if cfg.arch in ROPE_PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute_rope(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        yield name, w


def gguf_tokenizer(reader, path: Path):
    """A transformers fast tokenizer built from the GGUF vocabulary (BPE, byte-level, as llama.cpp's gpt2 model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(path, f"tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    digits = [pre_tokenizers.Digits(individual_digits=True)] if _field(reader, "tokenizer.ggml.pre") == "smollm" else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(digits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp token type 3 = control
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    name = lambda key: None if ids[key] is None else tokens[ids[key]]  # noqa: E731
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=name("bos"), eos_token=name("eos"), unk_token=name("unknown"),
        pad_token=name("padding"), additional_special_tokens=specials,
        chat_template=_field(reader, "tokenizer.chat_template"))
