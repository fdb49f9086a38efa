"""CUDA custom calls through the XLA FFI: paged decode attention, in-place KV-cache updates, the linear layers of
decode-sized steps (bf16 and W8A16), the W8A8 quantize and GEMM of larger steps, MoE routing, and the copy of a
step's input bytes that XLA runs outside its CUDA graphs.

Cache layout (shared with the Pallas kernels and the engine): per layer K and V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; block 0 is a null block for padding
writes; slot = block_id * block_size + offset. The cache is in q's dtype or float8_e4m3fn: the
engine writes FP8 k/v already quantized and folds the scales into q and the output, so the ops
only copy FP8 bytes and widen them to f32 when reading.

Each op has a pure-JAX ``*_reference`` beside it. The public functions run the CUDA
library when ``available()`` (an NVIDIA GPU, and nvcc built or found the cached library),
and otherwise the reference, after a one-line notice logged once naming why (a warning on a GPU machine). The
cache write and block copy run on the CPU library under the CPU backend (`custom_calls.cpu`: the same FFI names).
"""
import ctypes
import dataclasses
import functools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from custom_calls import build, cpu

log = logging.getLogger(__name__)

# FFI target name -> symbol exported by libjaxserve_cuda.so.
TARGETS = {
    "jaxserve_paged_decode_attention": "JaxservePagedDecodeAttention",
    "jaxserve_reshape_and_cache": "JaxserveReshapeAndCache",
    "jaxserve_rope_and_cache": "JaxserveRopeAndCache",
    "jaxserve_add_rms_norm": "JaxserveAddRmsNorm",
    "jaxserve_copy_blocks": "JaxserveCopyBlocks",
    "jaxserve_copy_outside_graphs": "JaxserveCopyOutsideGraphs",
    "jaxserve_decode_linear": "JaxserveDecodeLinear",
    "jaxserve_moe_route": "JaxserveMoeRoute",
    "jaxserve_fp8_quantize_rows": "JaxserveFp8QuantizeRows",
    "jaxserve_fp8_scaled_mm": "JaxserveFp8ScaledMm",
    "jaxserve_fp8_mm": "JaxserveFp8Mm",
}
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)   # q's, and a cache's in q's dtype
CACHE_DTYPES = (*DTYPES, jnp.float8_e4m3fn)
# what cache writes and block copies move: also an fp8 cache kept as its bits (uint8), as jaxserve keeps one on a
# CPU; the references move those (the CUDA calls take the cache dtypes above)
MOVED_DTYPES = (*CACHE_DTYPES, jnp.uint8)
HEAD_DIMS = (64, 128, 256)
# Split-K: aim for this many CTAs per SM, never slicing a sequence finer than
# MIN_SPLIT_TOKENS (each split pays a fixed setup and a partial write); MAX_SPLITS
# bounds the merge kernel.
TARGET_CTAS_PER_SM = 4
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 128
MAX_GROUP_TILE = 8  # query heads per CTA in the kernel
# the tensor-core kernel paged_decode_attention runs over an FP8 cache or one in q's bf16/f16 (paged_attention.cu,
# tc::Takes)
TENSOR_CORE_DECODE_HEAD_DIMS, TENSOR_CORE_DECODE_MAX_GROUP = (64, 128), 16
# decode linears (fp8_linear, bf16_linear): rows (tokens) a call takes; k per chunk (K must be a multiple); the
# launch's choices: CTA columns of warps (warps_n) and m16 tiles of output channels per warp (warp_tiles), N a
# multiple of 16 * warp_tiles * warps_n
DECODE_LINEAR_MAX_ROWS, DECODE_LINEAR_MAX_GROUPS = 16, 3   # weights of one input a launch reads (q, k, v)
DECODE_LINEAR_CHUNK_K = 64
DECODE_LINEAR_WARPS_N, DECODE_LINEAR_WARP_TILES = (1, 2), (2, 4)
# fp8_linear's default launch: (warps_n, warp_tiles) one warp column of two tiles, 32 channels a CTA, which every N
# it takes divides (the best or within 3% of it at every Llama-3-8B decode shape on an H100, `benchmarks/fp8_gemm.py
# --decode`), with K split until the CTAs cover FP8_LINEAR_CTAS_PER_SM a SM (down: 2; k or v alone: 4-5)
FP8_LINEAR_DEFAULT_TILE = (1, 2)
FP8_LINEAR_CTAS_PER_SM = 1
DECODE_LINEAR_CLUSTER_SPLITS = 8   # splits of K that meet in a cluster (the portable cluster size), not a workspace
BF16_LINEAR_MIN_FILL = 2 / 3   # of the SMs a bf16 launch gives a CTA before it splits K further (measured, H200)
# fp8_quantize_rows and fp8_scaled_mm: e4m3's largest finite value, which each row's amax maps to; the smallest
# normal f32, the scale of an all-zero row (padding tokens), which no other row's amax / FP8_MAX is below; widest
# row the quantize kernel keeps in registers; cuBLASLt's workspace (what cuBLAS sizes for Hopper)
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
FP8_MIN_SCALE = float(np.finfo(np.float32).tiny)
FP8_QUANTIZE_MAX_K = 32768
QUANTIZE_INPUTS = {"rows": 0, "silu_product": 1, "rms_norm": 2}   # what the quantize kernel quantizes (its `input`)
FP8_SCALED_MM_WORKSPACE = 32 << 20


def has_nvidia_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@functools.cache
def register(path: str) -> ctypes.CDLL:
    """Loads the library and registers its handlers for platform CUDA (works without a GPU)."""
    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="CUDA")
    return library


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CUDA path is off (None when on); the notice is logged once per process."""
    if not has_nvidia_gpu():
        reason = f"no NVIDIA GPU (JAX backend is {jax.default_backend()})"
    else:
        try:
            register(str(build.build_library()))
            reason = None
        except (build.BuildError, OSError) as err:
            reason = f"build failed: {err}"
    if reason:   # expected without a GPU; a GPU whose build failed is worth a warning
        (log.warning if has_nvidia_gpu() else log.info)(
            "jaxserve custom_calls: %s; using the pure-JAX reference path", reason)
    return reason


def available() -> bool:
    return unavailable_reason() is None


@functools.cache
def sm_count() -> int:
    return jax.devices("cuda")[0].core_count


def choose_num_splits(batch: int, kv_heads: int, group: int, max_tokens: int, sms: int) -> int:
    """Splits per sequence so that batch * kv_heads * head_tiles * splits fills the GPU."""
    ctas = batch * kv_heads * math.ceil(group / MAX_GROUP_TILE)
    wanted = math.ceil(TARGET_CTAS_PER_SM * sms / max(ctas, 1))
    return max(1, min(wanted, math.ceil(max_tokens / MIN_SPLIT_TOKENS), MAX_SPLITS))


def check_cache(k_cache, v_cache, dtypes=CACHE_DTYPES) -> None:
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {k_cache.shape}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.shape} {v_cache.dtype} must match k_cache {k_cache.shape} {k_cache.dtype}")
    if k_cache.dtype not in dtypes:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"k_cache dtype must be one of {names}, got {k_cache.dtype}")
    if k_cache.shape[3] * k_cache.dtype.itemsize % 16:
        raise ValueError(f"k_cache head_dim * itemsize must be a multiple of 16 bytes, got head_dim {k_cache.shape[3]}")


def check_index(name: str, array, ndim: int) -> None:
    if array.dtype != jnp.int32 or array.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d int32 array, got {array.dtype} of shape {array.shape}")


def check_decode_args(q, k_cache, v_cache, kv_lens, block_tables, sliding_window, soft_cap) -> None:
    check_cache(k_cache, v_cache)
    check_index("kv_lens", kv_lens, 1)
    check_index("block_tables", block_tables, 2)
    fp8 = k_cache.dtype == jnp.float8_e4m3fn
    if q.ndim != 3 or q.dtype not in (DTYPES if fp8 else (k_cache.dtype,)) or q.shape[2] != k_cache.shape[3]:
        dtype = "float32, bfloat16 or float16" if fp8 else k_cache.dtype
        raise ValueError(f"q must be [batch, q_heads, {k_cache.shape[3]}] in {dtype}, got {q.shape} {q.dtype}")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[2]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {k_cache.shape[2]}")
    if kv_lens.shape[0] != q.shape[0] or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"kv_lens {kv_lens.shape} and block_tables {block_tables.shape} must have batch {q.shape[0]}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap}")


def paged_decode_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale,
                                     sliding_window=None, soft_cap=None):
    """Decode attention in f32 over each sequence's gathered pages (an FP8 cache widened as stored), out in q's
    dtype; rows with kv_len 0 give zeros."""
    out, _ = paged_decode_partials_reference(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=sm_scale,
                                             sliding_window=sliding_window, soft_cap=soft_cap)
    return out[:, 0].astype(q.dtype)


def paged_decode_partials_reference(q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale, sliding_window=None,
                                    soft_cap=None):
    """paged_decode_partials as one split: (out [B, 1, Hq, D] f32, its log2-sum-exp [B, 1, Hq]; -inf and zeros
    for rows with kv_len 0)."""
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    ctx = block_tables.shape[1] * block_size
    pages = jnp.clip(block_tables, 0, num_blocks - 1)
    keys = k_cache[pages].reshape(batch, ctx, kv_heads, head_dim).astype(jnp.float32)
    values = v_cache[pages].reshape(batch, ctx, kv_heads, head_dim).astype(jnp.float32)
    queries = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bhgd,bthd->bhgt", queries, keys, precision=jax.lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    lens = jnp.clip(kv_lens, 0, ctx)[:, None]
    pos = jnp.arange(ctx)[None, :]
    live = pos < lens
    if sliding_window is not None:
        live &= pos > lens - 1 - sliding_window  # key pos > query pos - window
    scores = jnp.where(live[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(probs, axis=-1, keepdims=True)
    values = jnp.where(live[:, :, None, None], values, 0.0)  # unused slots may hold anything
    out = jnp.einsum("bhgt,bthd->bhgd", probs, values, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    lse = jnp.where(total > 0, (top + jnp.log(jnp.where(total > 0, total, 1.0))) * math.log2(math.e), -jnp.inf)
    return out.reshape(batch, 1, q_heads, head_dim), lse.reshape(batch, 1, q_heads)


def tensor_core_decode_takes(q_dtype, cache_dtype, head_dim: int, group: int, block_size: int) -> bool:
    """Whether paged_decode_attention runs its tensor-core kernel here: a bf16 or f16 q over an FP8 cache or one of
    its own dtype, head_dim 64 or 128, up to 16 query heads a kv head, power-of-two pages (other shapes take the f32
    kernel)."""
    q_dtype, cache_dtype = jnp.dtype(q_dtype), jnp.dtype(cache_dtype)
    return (q_dtype in (jnp.bfloat16, jnp.float16) and cache_dtype in (jnp.float8_e4m3fn, q_dtype)
            and head_dim in TENSOR_CORE_DECODE_HEAD_DIMS and group <= TENSOR_CORE_DECODE_MAX_GROUP
            and block_size & (block_size - 1) == 0)


def call_paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale, sliding_window,
                                soft_cap, num_splits, partials: bool = False):
    """The FFI call itself (the library must be registered): the output, or with `partials` the workspace the
    splits' partials fill (unpack_partials reads it)."""
    batch, q_heads, head_dim = q.shape
    workspace = batch * q_heads * num_splits * (head_dim + 2) if num_splits > 1 or partials else 1
    out, spilled = jax.ffi.ffi_call(
        "jaxserve_paged_decode_attention",
        (jax.ShapeDtypeStruct((1,) if partials else q.shape, q.dtype),
         jax.ShapeDtypeStruct((workspace,), jnp.float32)),
    )(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=np.float32(sm_scale),
      sliding_window=np.int32(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
      num_splits=np.int32(num_splits), partials=np.int32(partials))
    return spilled if partials else out


def unpack_partials(workspace, batch: int, q_heads: int, num_splits: int, head_dim: int):
    """The call's partials (each split's unnormalised sums [B, Hq, S, D], then its (max, sum) [B, Hq, S, 2], both in
    the log2 domain) as paged_decode_partials gives them."""
    parts = batch * q_heads * num_splits
    acc = workspace[:parts * head_dim].reshape(batch, q_heads, num_splits, head_dim)
    top, total = jnp.moveaxis(workspace[parts * head_dim:parts * (head_dim + 2)].reshape(batch, q_heads,
                                                                                         num_splits, 2), -1, 0)
    live = total > 0
    safe = jnp.where(live, total, 1.0)
    out = jnp.where(live[..., None], acc / safe[..., None], 0.0)
    return out.transpose(0, 2, 1, 3), jnp.where(live, top + jnp.log2(safe), -jnp.inf).transpose(0, 2, 1)


def paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale, sliding_window=None,
                           soft_cap=None, num_splits=None):
    """Attention of q [B, Hq, D] (the token at position kv_lens[b] - 1) over its paged K/V, in q's dtype or
    float8_e4m3fn (read as stored: no scale applied).

    kv_lens [B] int32 counts the current token; block_tables [B, max_blocks] int32.
    Keys with pos > qpos - sliding_window are seen; soft_cap applies cap * tanh(s / cap)
    to the scaled scores. num_splits (split-K slices per sequence) defaults to a choice
    from the batch, kv heads and SM count.
    """
    check_decode_args(q, k_cache, v_cache, kv_lens, block_tables, sliding_window, soft_cap)
    if not available():
        return paged_decode_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=sm_scale,
                                                sliding_window=sliding_window, soft_cap=soft_cap)
    return call_paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=sm_scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap,
                                       num_splits=decode_splits(q, k_cache, block_tables, num_splits))


def decode_splits(q, k_cache, block_tables, num_splits: int | None) -> int:
    """num_splits checked, or where None choose_num_splits' for the call's shapes."""
    if num_splits is None:
        return choose_num_splits(q.shape[0], k_cache.shape[2], q.shape[1] // k_cache.shape[2],
                                 block_tables.shape[1] * k_cache.shape[1], sm_count())
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return num_splits


def paged_decode_partials(q, k_cache, v_cache, kv_lens, block_tables, *, sm_scale, sliding_window=None,
                          soft_cap=None, num_splits=None):
    """paged_decode_attention's splits unmerged, for a caller that merges them with partials of its own (cascade
    attention's shared prefix): (out [B, S, Hq, D] float32, each split's attention normalised; its log2-sum-exp
    [B, S, Hq], -inf where the split has no keys)."""
    check_decode_args(q, k_cache, v_cache, kv_lens, block_tables, sliding_window, soft_cap)
    if not available():
        return paged_decode_partials_reference(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=sm_scale,
                                               sliding_window=sliding_window, soft_cap=soft_cap)
    num_splits = decode_splits(q, k_cache, block_tables, num_splits)
    workspace = call_paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=sm_scale,
                                            sliding_window=sliding_window, soft_cap=soft_cap, num_splits=num_splits,
                                            partials=True)
    return unpack_partials(workspace, *q.shape[:2], num_splits, q.shape[2])


def check_write_args(k_cache, v_cache, k, v, slot_mapping) -> None:
    check_cache(k_cache, v_cache, MOVED_DTYPES)
    check_index("slot_mapping", slot_mapping, 1)
    row = (slot_mapping.shape[0], *k_cache.shape[2:])
    for name, new in (("k", k), ("v", v)):
        if new.shape != row or new.dtype != k_cache.dtype:
            raise ValueError(f"{name} must be {row} in {k_cache.dtype}, got {new.shape} {new.dtype}")


def reshape_and_cache_reference(k_cache, v_cache, k, v, slot_mapping):
    """Writes k/v [T, Hkv, D] at slot_mapping [T]; slots outside the cache (e.g. -1) are dropped."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping < num_slots), slot_mapping, num_slots)

    def write(cache, new):
        rows = cache.reshape(num_slots, *cache.shape[2:])
        return rows.at[slots].set(new, mode="drop").reshape(cache.shape)

    return write(k_cache, k), write(v_cache, v)


def moves_in_place(cache_dtype) -> bool:
    """Whether the cache write and block copy run as custom calls here: the CUDA library's (caches of
    CACHE_DTYPES) on an NVIDIA GPU, the CPU library's (byte copies: any dtype) under the CPU backend."""
    return (available() and cache_dtype in CACHE_DTYPES) or cpu.available()


def call_in_place(target: str, k_cache, v_cache, *args):
    """FFI call updating k_cache and v_cache in place (aliased inputs 0, 1 -> outputs 0, 1)."""
    cache = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    k_out, v_out = jax.ffi.ffi_call(target, (cache, cache), input_output_aliases={0: 0, 1: 1})(k_cache, v_cache, *args)
    return k_out, v_out


def copy_outside_graphs(x):
    """x [N] bytes as they are; on an NVIDIA GPU a copy that XLA runs outside its CUDA graphs (the call has no
    command-buffer trait): a graph whose only reader of x this is reads a new buffer at every run without being
    recorded again, the copy landing in its temp buffer, whose address stays."""
    if x.dtype != jnp.uint8 or x.ndim != 1:
        raise ValueError(f"copy_outside_graphs takes uint8 [N], got {x.dtype} {x.shape}")
    return call_copy_outside_graphs(x) if available() else x


def call_copy_outside_graphs(x):
    return jax.ffi.ffi_call("jaxserve_copy_outside_graphs", jax.ShapeDtypeStruct(x.shape, jnp.uint8))(x)


def reshape_and_cache(k_cache, v_cache, k, v, slot_mapping):
    """reshape_and_cache_reference in place on the (donated) caches; returns (k_cache, v_cache). The calls take k
    and v stacked, one operand: XLA then computes both (k's rope, v's slice of the q/k/v projection, an FP8
    cache's quantization) in one fusion, where two operands would each be a kernel of their own."""
    check_write_args(k_cache, v_cache, k, v, slot_mapping)
    if not moves_in_place(k_cache.dtype):
        return reshape_and_cache_reference(k_cache, v_cache, k, v, slot_mapping)
    return call_in_place("jaxserve_reshape_and_cache", k_cache, v_cache, jnp.stack([k, v]), slot_mapping)


def rope(x, positions, inv_freq):
    """x [T, H, D] rotated by positions [T] (rotary embeddings, HF's rotate-half layout: element i pairs with
    i + D / 2) in f32, rounded to x's dtype."""
    freqs = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def fp8_cache_rows(x, scale):
    """x [T, Hkv, D] / scale [Hkv] in e4m3, clipped first: e4m3fn has no infinity, an overflowing conversion is
    NaN."""
    return jnp.clip(x.astype(jnp.float32) / scale[None, :, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """What rope_and_cache applies to q's and k's heads: the rotation's inverse frequencies [D / 2] and, for models
    that norm q and k per head (Qwen3), their RMSNorm weights [D] and epsilon."""
    inv_freq: jax.Array
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    eps: float = 0.0


def rope_and_cache_reference(k_cache, v_cache, qkv, positions, slot_mapping, rotary: Rotary, num_q_heads: int,
                             k_scale=None, v_scale=None):
    """A fused q/k/v projection's rows qkv [T, (Hq + 2 Hkv) D] -> (q [T, Hq, D], k_cache, v_cache): q's and k's
    heads RMS-normed (rms_norm, where rotary has the weights) and rotated (rope); k and v written at slot_mapping
    (reshape_and_cache_reference). Over an e4m3 cache k and v divided by their scales [Hkv] (fp8_cache_rows) and q
    multiplied by k_scale, so that attention reads the stored k unscaled."""
    hkv, d = k_cache.shape[2:]
    q, k, v = jnp.split(qkv.reshape(qkv.shape[0], -1, d), [num_q_heads, num_q_heads + hkv], axis=1)
    if rotary.q_norm is not None:
        q, k = rms_norm(q, rotary.q_norm, rotary.eps), rms_norm(k, rotary.k_norm, rotary.eps)
    q, k = rope(q, positions, rotary.inv_freq), rope(k, positions, rotary.inv_freq)
    if k_cache.dtype == jnp.float8_e4m3fn:
        q = (q * jnp.repeat(k_scale, num_q_heads // hkv)[None, :, None]).astype(q.dtype)
        k, v = fp8_cache_rows(k, k_scale), fp8_cache_rows(v, v_scale)
    return q, *reshape_and_cache_reference(k_cache, v_cache, k.astype(k_cache.dtype), v.astype(v_cache.dtype),
                                           slot_mapping)


def rope_and_cache_unsupported(k_cache, v_cache, qkv, num_q_heads: int) -> str | None:
    """Why the CUDA call cannot take these (None when it can)."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        return f"k_cache and v_cache must be one [blocks, block_size, Hkv, D] shape, got {k_cache.shape} and " \
               f"{v_cache.shape}"
    hkv, d = k_cache.shape[2:]
    if qkv.dtype not in (jnp.bfloat16, jnp.float16) or k_cache.dtype not in (qkv.dtype, jnp.float8_e4m3fn):
        return f"qkv must be bfloat16 or float16 and the caches in its dtype or float8_e4m3fn, got {qkv.dtype} and " \
               f"{k_cache.dtype}"
    if d not in HEAD_DIMS or num_q_heads % hkv or qkv.ndim != 2 or qkv.shape[1] != (num_q_heads + 2 * hkv) * d:
        return f"qkv must be [T, (Hq + 2 Hkv) D] with D in {HEAD_DIMS} and Hkv dividing Hq, got {qkv.shape} " \
               f"for Hq {num_q_heads}, Hkv {hkv}, D {d}"
    return None


def rope_and_cache(k_cache, v_cache, qkv, positions, slot_mapping, rotary: Rotary, num_q_heads: int,
                   k_scale=None, v_scale=None):
    """rope_and_cache_reference in one CUDA call, the (donated) caches written in place: the norms, the rotation,
    an FP8 cache's scales and the write in one kernel, where XLA runs them as three. Without the library, or for
    what the call does not take (rope_and_cache_unsupported), the reference."""
    if not available() or rope_and_cache_unsupported(k_cache, v_cache, qkv, num_q_heads):
        return rope_and_cache_reference(k_cache, v_cache, qkv, positions, slot_mapping, rotary, num_q_heads,
                                        k_scale, v_scale)
    return call_rope_and_cache(k_cache, v_cache, qkv, positions, slot_mapping, rotary, num_q_heads, k_scale, v_scale)


def call_rope_and_cache(k_cache, v_cache, qkv, positions, slot_mapping, rotary: Rotary, num_q_heads: int,
                        k_scale=None, v_scale=None):
    """The FFI call itself (the library must be registered): (q, k_cache, v_cache), the caches aliased."""
    hkv, d = k_cache.shape[2:]
    ones = jnp.ones(hkv, jnp.float32)
    none = jnp.zeros((0,), qkv.dtype)
    cache = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    k_out, v_out, q = jax.ffi.ffi_call("jaxserve_rope_and_cache", (
        cache, cache, jax.ShapeDtypeStruct((qkv.shape[0], num_q_heads, d), qkv.dtype)),
        input_output_aliases={0: 0, 1: 1})(
        k_cache, v_cache, qkv, positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
        jnp.asarray(rotary.inv_freq, jnp.float32), none if rotary.q_norm is None else rotary.q_norm.astype(qkv.dtype),
        none if rotary.k_norm is None else rotary.k_norm.astype(qkv.dtype),
        *(ones if scale is None else scale.astype(jnp.float32) for scale in (k_scale, v_scale)),
        num_q_heads=np.int32(num_q_heads), eps=np.float32(rotary.eps))
    return q, k_out, v_out


def check_copy_args(k_cache, v_cache, src, dst) -> None:
    check_cache(k_cache, v_cache, MOVED_DTYPES)
    check_index("src", src, 1)
    check_index("dst", dst, 1)
    if src.shape != dst.shape:
        raise ValueError(f"src {src.shape} and dst {dst.shape} must have the same length")


def copy_blocks_reference(k_cache, v_cache, src, dst):
    """Block src[i] -> dst[i] in both caches (dst distinct, disjoint from src); pairs with an id outside the cache are skipped."""
    num_blocks = k_cache.shape[0]
    valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    targets = jnp.where(valid, dst, num_blocks)
    sources = jnp.clip(src, 0, num_blocks - 1)
    return (k_cache.at[targets].set(k_cache[sources], mode="drop"),
            v_cache.at[targets].set(v_cache[sources], mode="drop"))


def copy_blocks(k_cache, v_cache, src, dst):
    """copy_blocks_reference in place on the (donated) caches; returns (k_cache, v_cache)."""
    check_copy_args(k_cache, v_cache, src, dst)
    if not moves_in_place(k_cache.dtype):
        return copy_blocks_reference(k_cache, v_cache, src, dst)
    return call_in_place("jaxserve_copy_blocks", k_cache, v_cache, src, dst)


def decode_linear_unsupported(x, weights, scales=None) -> str | None:
    """Why the decode linear kernel cannot take x [M, K] and the weights (None when it can): e4m3 w_g [N_g, K] with
    scales [N_g] (fp8_linear), or without scales bf16 w_g [K, N_g] (bf16_linear, nnx.Linear's kernel layout)."""
    kn = scales is None
    if not 1 <= len(weights) <= DECODE_LINEAR_MAX_GROUPS or not (kn or len(scales) == len(weights)):
        return f"takes 1 to {DECODE_LINEAR_MAX_GROUPS} weights{'' if kn else ' with a scale each'}, got " \
               f"{len(weights)}{'' if kn else f' and {len(scales)}'}"
    if x.ndim != 2 or x.dtype != jnp.bfloat16 or not 1 <= x.shape[0] <= DECODE_LINEAR_MAX_ROWS:
        return f"x must be bfloat16 [1 to {DECODE_LINEAR_MAX_ROWS}, K], got {x.dtype} {x.shape}"
    if x.shape[1] % DECODE_LINEAR_CHUNK_K:
        return f"K must be a multiple of {DECODE_LINEAR_CHUNK_K}, got {x.shape[1]}"
    for i, w in enumerate(weights):
        k, n = (w.shape if kn else w.shape[::-1]) if w.ndim == 2 else (None, None)
        if kn and (w.dtype != jnp.bfloat16 or k != x.shape[1]):
            return f"each w must be bfloat16 [{x.shape[1]}, N], got {w.dtype} {w.shape}"
        if not kn and (w.dtype != jnp.float8_e4m3fn or k != x.shape[1] or scales[i].shape != (n,)):
            return f"each w must be float8_e4m3fn [N, {x.shape[1]}] with a scale [N], got {w.dtype} {w.shape} " \
                   f"and {scales[i].shape}"
        if n % 32:
            return f"each w's N must be a multiple of 32, got {n}"
    return None


def fp8_linear_reference(x, w, scale, live=None):
    """y [M, N] = (x [M, K] . w [N, K]^T) * scale [N] in x's dtype: the e4m3 weight widened to x's dtype, products
    summed in f32; with live (int32 [] or [1]: the first rows that are real) the rows past them zeros."""
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return live_rows((y * scale).astype(x.dtype), live)


def fp8_gated_linear_reference(x, w_gate, s_gate, w_up, s_up, live=None):
    """silu(gate) * up [M, N] in x's dtype of gate and up = (x . w^T) * scale in f32 (fp8_linear_reference's sums
    before their rounding): the MLP's product, rounded once."""
    gate, up = (jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                * s for w, s in ((w_gate, s_gate), (w_up, s_up)))
    return live_rows((jax.nn.silu(gate) * up).astype(x.dtype), live)


def bf16_linear_reference(x, w, live=None):
    """y [M, N] = x [M, K] . w [K, N] in x's dtype, products summed in f32; with live the rows past them zeros."""
    return live_rows(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), live)


def live_rows(y, live):
    """y with its rows from live on (int32 [] or [1]; None: none) zeros."""
    return y if live is None else jnp.where(jnp.arange(y.shape[0])[:, None] < live.reshape(()), y, 0)


def choose_linear_launch(ns: tuple[int, ...], k: int, sms: int) -> tuple[int, int, int]:
    """fp8_linear's (splits, warps_n, warp_tiles) for e4m3 weights of n output channels (n in ns) and K k:
    FP8_LINEAR_DEFAULT_TILE, K split to fill the SMs while each split keeps 8 chunks."""
    warps_n, warp_tiles = FP8_LINEAR_DEFAULT_TILE
    tiles, chunks = sum(ns) // (16 * warp_tiles * warps_n), k // DECODE_LINEAR_CHUNK_K
    return max(1, min(math.ceil(FP8_LINEAR_CTAS_PER_SM * sms / tiles), chunks // 8)), warps_n, warp_tiles


def choose_bf16_launch(ns: tuple[int, ...], k: int, sms: int) -> tuple[int, int, int]:
    """bf16_linear's (splits, warps_n, warp_tiles), as the H200 sweep (benchmarks/bf16_decode_gemm.py) ranks them:
    a split of K costs more than a CTA short of a full wave, so the fewest splits that give at least
    BF16_LINEAR_MIN_FILL of the SMs a CTA; among those the CTA count nearest the SM count, then more tiles a warp
    (wider loads). Where no launch fills that many, the most CTAs."""
    chunks = k // DECODE_LINEAR_CHUNK_K
    tiles = [(w, t) for t in (4, 2) for w in (1, 2) if not any(n % (16 * w * t) for n in ns)]
    options = [(splits, sum(ns) // (16 * w * t) * splits, (splits, w, t)) for w, t in tiles
               for splits in range(1, max(1, min(chunks // 4, DECODE_LINEAR_CLUSTER_SPLITS)) + 1)]
    filling = [o for o in options if o[1] >= BF16_LINEAR_MIN_FILL * sms]
    if not filling:
        return max(options, key=lambda o: (o[1], -o[0]))[-1]
    fewest = min(o[0] for o in filling)
    return min((o for o in filling if o[0] == fewest), key=lambda o: abs(o[1] - sms))[-1]


def fp8_linear(x, weights, scales, *, launch=None, live=None) -> list:
    """[fp8_linear_reference(x, w, s, live) for w, s in zip(weights, scales)] through the CUDA kernel, in one launch:
    one read of each e4m3 weight on the tensor cores, for the decode-sized steps (up to DECODE_LINEAR_MAX_ROWS rows)
    that such reads bound; with live (the step's real rows, the first ones: int32 [] or [1]) the kernel reads no
    activation past them. decode_linear_unsupported names what it does not take. Without the library it runs the
    reference. launch (splits of K, warps_n, warp_tiles) defaults to choose_linear_launch."""
    return decode_linear(x, weights, scales, launch, live)


def fp8_gated_linear(x, w_gate, s_gate, w_up, s_up, *, launch=None, live=None):
    """fp8_gated_linear_reference through the CUDA kernel in one launch: both e4m3 weights [N, K] read once, the
    product made where a channel's gate and up sums meet (no product kernel after the launch). As fp8_linear
    otherwise; gate and up must be of one shape."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"fp8_gated_linear: gate and up must be of one shape, got {w_gate.shape} and {w_up.shape}")
    return decode_linear(x, [w_gate, w_up], [s_gate, s_up], launch, live, gated=True)[0]


def bf16_linear(x, weights, *, launch=None, live=None) -> list:
    """[bf16_linear_reference(x, w, live) for w in weights], bf16 weights [K, N] (nnx.Linear's kernels) that read
    x, through the CUDA kernel in one launch, as fp8_linear (launch default: choose_bf16_launch)."""
    return decode_linear(x, weights, None, launch, live)


def decode_linear(x, weights, scales, launch, live, gated: bool = False) -> list:
    """fp8_linear (scales given), fp8_gated_linear (gated) or bf16_linear (scales None): checked, then the kernel
    or, without the library, the reference."""
    name = "bf16_linear" if scales is None else "fp8_gated_linear" if gated else "fp8_linear"
    if why := decode_linear_unsupported(x, weights, scales):
        raise ValueError(f"{name}: {why}")
    ns, k = tuple(w.shape[1] if scales is None else w.shape[0] for w in weights), x.shape[1]
    if launch is not None:
        check_linear_launch(launch, ns, k)
    if not available() and scales is None:
        return [bf16_linear_reference(x, w, live) for w in weights]
    if not available():
        return [fp8_gated_linear_reference(x, weights[0], scales[0], weights[1], scales[1], live)] if gated else \
            [fp8_linear_reference(x, w, s, live) for w, s in zip(weights, scales)]
    choose = choose_bf16_launch if scales is None else choose_linear_launch
    return call_decode_linear(x, weights, scales, launch=launch or choose(ns, k, sm_count()), live=live,
                              gated=gated)


def check_linear_launch(launch, ns: tuple[int, ...], k: int) -> None:
    splits, warps_n, warp_tiles = launch
    if not 1 <= splits <= k // DECODE_LINEAR_CHUNK_K:
        raise ValueError(f"decode linear: splits must be in [1, {k // DECODE_LINEAR_CHUNK_K}], got {splits}")
    if warps_n not in DECODE_LINEAR_WARPS_N or warp_tiles not in DECODE_LINEAR_WARP_TILES:
        raise ValueError(f"decode linear: warps_n must be one of {DECODE_LINEAR_WARPS_N} and warp_tiles one of "
                         f"{DECODE_LINEAR_WARP_TILES}, got {warps_n} and {warp_tiles}")
    if any(n % (16 * warp_tiles * warps_n) for n in ns):
        raise ValueError(f"decode linear: each N ({ns}) must be a multiple of 16 * warp_tiles * warps_n = "
                         f"{16 * warp_tiles * warps_n}")


def call_decode_linear(x, weights, scales, *, launch: tuple[int, int, int], live=None, gated: bool = False) -> list:
    """The FFI call itself (the library must be registered): e4m3 weights [N, K] with their scales, or (scales
    None) bf16 weights [K, N]; gated, one output of e4m3 gate and up. Splits of K meet in a cluster's shared
    memory on sm_90, elsewhere as f32 partials in the workspace."""
    splits, warps_n, warp_tiles = launch
    kn = scales is None
    ns = [w.shape[1] if kn else w.shape[0] for w in weights]
    workspace = splits * x.shape[0] * sum(ns) if splits > 1 else 1
    outs = [jax.ShapeDtypeStruct((x.shape[0], n), x.dtype) for n in ns[:1 if gated else None]]
    operands = weights if kn else [a for w, s in zip(weights, scales) for a in (w, s.astype(jnp.float32))]
    *ys, _ = jax.ffi.ffi_call("jaxserve_decode_linear", (*outs, jax.ShapeDtypeStruct((workspace,), jnp.float32)))(
        x, *operands, *(() if live is None else (live.reshape(1).astype(jnp.int32),)), splits=np.int32(splits),
        warps_n=np.int32(warps_n), warp_tiles=np.int32(warp_tiles), with_live=np.int32(live is not None),
        weights_kn=np.int32(kn), gated=np.int32(gated))
    return ys


def fp8_quantize_rows_reference(x, up=None) -> tuple[jax.Array, jax.Array]:
    """x [N, K], or silu(x) * up -> (e4m3 [N, K], f32 scale [N, 1]) with it ~ q * scale: each row's amax maps to
    FP8_MAX. Clipped before the cast: e4m3fn has no infinity, an overflowing conversion is NaN, and amax / scale can
    round past FP8_MAX."""
    h = x if up is None else jax.nn.silu(x) * up
    hf = h.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(hf), axis=-1, keepdims=True) * (1 / FP8_MAX), FP8_MIN_SCALE)
    return jnp.clip(hf * (1 / scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def rms_norm(x, weight, eps: float):
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, normalised in f32 and rounded to x's dtype before the
    weight's product (Llama's RMSNorm)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


ADD_RMS_NORM_MAX_WIDTH = 8192   # a row's elements the kernel keeps in registers (256 threads x 4 vectors of 8)


def add_rms_norm_unsupported(x, delta, weight) -> str | None:
    """Why the CUDA call cannot take these (None when it can)."""
    if x.dtype not in (jnp.bfloat16, jnp.float16) or delta.dtype != x.dtype or weight.dtype != x.dtype:
        return f"x, delta and weight must share one dtype, bfloat16 or float16, got {x.dtype}, {delta.dtype} and " \
               f"{weight.dtype}"
    if x.ndim != 2 or delta.shape != x.shape or weight.shape != x.shape[1:] or x.shape[1] % 8 or \
            x.shape[1] > ADD_RMS_NORM_MAX_WIDTH:
        return f"x and delta must be one [T, H] shape and weight [H], H a multiple of 8 up to " \
               f"{ADD_RMS_NORM_MAX_WIDTH}, got {x.shape}, {delta.shape} and {weight.shape}"
    return None


def add_rms_norm_reference(x, delta, weight, eps: float):
    """(rms_norm(x + delta), x + delta): a residual stream's add and the norm after it."""
    total = x + delta
    return rms_norm(total, weight, eps), total


def add_rms_norm(x, delta, weight, eps: float):
    """add_rms_norm_reference in one CUDA launch, where XLA runs the add and the norm as two (the sum written and
    read back between them). Without the library, or for what the call does not take
    (add_rms_norm_unsupported), the reference."""
    if not available() or add_rms_norm_unsupported(x, delta, weight):
        return add_rms_norm_reference(x, delta, weight, eps)
    return call_add_rms_norm(x, delta, weight, eps)


def call_add_rms_norm(x, delta, weight, eps: float):
    """The FFI call itself (the library must be registered): (normed, sum), the sum over x's buffer."""
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ffi.ffi_call("jaxserve_add_rms_norm", (out, out), input_output_aliases={0: 1})(
        x, delta, weight, eps=np.float32(eps))


def fp8_scaled_mm_reference(x, x_scale, w, w_scale, dtype=jnp.bfloat16):
    """y [N, M] = (x [N, K] . w [M, K]^T) * x_scale [N, 1] * w_scale [M] in dtype: both operands e4m3, never
    widened before the dot (XLA lowers it to cuBLASLt's FP8 GEMM with an f32 result)."""
    return (fp8_mm_reference(x, w) * x_scale * w_scale).astype(dtype)


def fp8_mm_reference(x, w):
    """y [N, M] = x [N, K] . w [M, K]^T in f32, both operands e4m3, never widened before the dot."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@functools.cache
def has_cublaslt() -> bool:
    """Whether the registered library holds fp8_scaled_mm and fp8_mm (built where cuBLASLt's header was found)."""
    return available() and bool(register(str(build.build_library())).JaxserveHasCublasLt())


def fp8_w8a8_unsupported(x, w) -> str | None:
    """Why the W8A8 kernels cannot take x [N, K] (bf16 before fp8_quantize_rows, e4m3 after it) and the e4m3
    weight w [M, K] (None when they can)."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn) or x.shape[1] % 16 or \
            x.shape[1] > FP8_QUANTIZE_MAX_K:
        return f"x must be bfloat16 or float8_e4m3fn [N, K] with K a multiple of 16 up to {FP8_QUANTIZE_MAX_K}, " \
               f"got {x.dtype} {x.shape}"
    if w.dtype != jnp.float8_e4m3fn or w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 16:
        return f"w must be float8_e4m3fn [M, {x.shape[1]}] with M a multiple of 16, got {w.dtype} {w.shape}"
    if not has_cublaslt():
        return "the CUDA library is unavailable or was built without cuBLASLt"
    return None


def quantize_kernel_unsupported(x) -> bool:
    """Whether the quantize kernel cannot take x (it takes bf16 [N, K], K a multiple of 8 up to FP8_QUANTIZE_MAX_K)."""
    return bool(x.ndim != 2 or x.dtype != jnp.bfloat16 or x.shape[1] % 8 or x.shape[1] > FP8_QUANTIZE_MAX_K or
                not available())


def fp8_quantize_rows(x, up=None):
    """fp8_quantize_rows_reference(x, up) through the CUDA kernel, one read of the input, where it runs (bf16 x
    [N, K], K a multiple of 8 up to FP8_QUANTIZE_MAX_K); else the reference."""
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"fp8_quantize_rows: up must match x, got {up.dtype} {up.shape} and {x.dtype} {x.shape}")
    if quantize_kernel_unsupported(x):
        return fp8_quantize_rows_reference(x, up)
    return call_fp8_quantize_rows(x, up, input=QUANTIZE_INPUTS["rows" if up is None else "silu_product"])


def fp8_rms_norm_quantize_rows(x, weight, eps: float):
    """fp8_quantize_rows_reference(rms_norm(x, weight, eps)) through the CUDA kernel, one read of x, where it runs
    (bf16 x [N, K] and weight [K], K a multiple of 8 up to FP8_QUANTIZE_MAX_K); else the reference. The kernel's sum
    of squares runs in another order than XLA's: a row's normalised values may round to bf16 differently."""
    if quantize_kernel_unsupported(x) or weight.shape != x.shape[1:] or weight.dtype != x.dtype:
        return fp8_quantize_rows_reference(rms_norm(x, weight, eps))
    return call_fp8_quantize_rows(x, weight, input=QUANTIZE_INPUTS["rms_norm"], eps=eps)


def fp8_scaled_mm(x, x_scale, w, w_scale):
    """fp8_scaled_mm_reference(x, x_scale, w, w_scale) in bf16 through cuBLASLt's FP8 GEMM with both scales in its
    epilogue, where it runs (fp8_w8a8_unsupported); else the reference."""
    if fp8_w8a8_unsupported(x, w):
        return fp8_scaled_mm_reference(x, x_scale, w, w_scale)
    return call_fp8_scaled_mm(x, x_scale, w, w_scale)


def fp8_mm(x, w):
    """fp8_mm_reference(x, w) through cuBLASLt's FP8 GEMM without scales (its split-K kernels among those it may
    pick), where it runs (fp8_w8a8_unsupported); else the reference."""
    if fp8_w8a8_unsupported(x, w):
        return fp8_mm_reference(x, w)
    return call_fp8_mm(x, w)


def call_fp8_quantize_rows(x, other=None, *, input: int, eps: float = 0.0):
    """The FFI call of the quantize (the library must be registered): (e4m3 [N, K], f32 scale [N, 1]) of x, or of
    what x and `other` (up, or the norm's weight) make (QUANTIZE_INPUTS)."""
    q, scale = jax.ffi.ffi_call("jaxserve_fp8_quantize_rows", (
        jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32)))(
        *((x,) if other is None else (x, other)), input=np.int32(input), eps=np.float32(eps))
    return q, scale


def call_fp8_scaled_mm(x, x_scale, w, w_scale):
    """The FFI call of the GEMM (the library must be registered, with cuBLASLt): bf16 [N, M]."""
    y, _ = jax.ffi.ffi_call("jaxserve_fp8_scaled_mm", (
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.bfloat16),
        jax.ShapeDtypeStruct((FP8_SCALED_MM_WORKSPACE,), jnp.uint8)))(
        x, w, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))
    return y


def call_fp8_mm(x, w):
    """The FFI call of the unscaled GEMM (the library must be registered, with cuBLASLt): f32 [N, M]."""
    y, _ = jax.ffi.ffi_call("jaxserve_fp8_mm", (
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32),
        jax.ShapeDtypeStruct((FP8_SCALED_MM_WORKSPACE,), jnp.uint8)))(x, w)
    return y


# moe_route: picks a lane of a warp holds; experts a warp's registers hold (more: the reference runs)
MOE_ROUTE_MAX_TOP_K, MOE_ROUTE_MAX_EXPERTS = 32, 512


class MoeRouting(NamedTuple):
    """A step's token-expert pairs (pair (t, j): token t's j-th pick) planned for the grouped GEMM
    (pallas_kernels.grouped_matmul_mgpu): weights [T, k] f32; sorted_tokens [margin_rows(T * k)]: the token of each
    sorted row (pairs sorted by local expert; rows past the routed pairs: token 0); the plan's tile_groups,
    tile_rows and num_tiles; pair_rows [T, k]: each pair's row in the padded output, past it for pairs routed to
    no local expert (padding tokens', another device's)."""
    weights: jax.Array
    sorted_tokens: jax.Array
    tile_groups: jax.Array
    tile_rows: jax.Array
    num_tiles: jax.Array
    pair_rows: jax.Array


def select_experts(logits, num_live, top_k: int, renormalize: bool):
    """Each token's top_k experts by its router logits [T, E]: (weights [T, k] f32, the softmax over all experts or
    with `renormalize` over the picks; experts [T, k] int32). Tokens from num_live [1] on are padding: expert E
    (routed nowhere), weight 0. Equal logits: the lower expert first."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    live = jnp.arange(logits.shape[0])[:, None] < num_live[0]
    return jnp.where(live, weights, 0.0), jnp.where(live, experts, logits.shape[1])


def sort_pairs(experts, expert_base, local_experts: int):
    """The pairs of experts [T, k] sorted by local expert (experts expert_base[0] on; pairs routed elsewhere last):
    (order [T * k] of flat pair indices, group_sizes [local_experts] int32)."""
    slot = experts.reshape(-1) - expert_base[0]
    slot = jnp.where((slot >= 0) & (slot < local_experts), slot, local_experts)
    order = jnp.argsort(slot, stable=True)
    return order, jnp.bincount(slot, length=local_experts + 1)[:local_experts].astype(jnp.int32)


def inverse_permutation(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def moe_route_reference(logits, num_live, expert_base, *, top_k: int, renormalize: bool, local_experts: int,
                        block_m: int) -> MoeRouting:
    """moe_route by XLA: select_experts, a stable sort by expert and the grouped GEMM's plan_rows (rows within a
    group in pair order)."""
    from pallas_kernels import grouped_matmul_mgpu as gmm   # Mosaic GPU's import: only where the plan is wanted
    weights, experts = select_experts(logits, num_live, top_k, renormalize)
    order, group_sizes = sort_pairs(experts, expert_base, local_experts)
    plan, slots = gmm.plan_rows(group_sizes, order.shape[0], block_m)
    routed = jnp.arange(order.shape[0]) < group_sizes.sum()
    sorted_tokens = jnp.where(routed, order // top_k, 0).astype(jnp.int32)
    sorted_tokens = jnp.pad(sorted_tokens, (0, gmm.margin_rows(order.shape[0], block_m) - order.shape[0]))
    pair_rows = slots[inverse_permutation(order)].reshape(experts.shape)
    return MoeRouting(weights, sorted_tokens, plan.tile_groups, plan.tile_rows, plan.num_tiles, pair_rows)


def moe_route_unsupported(logits, top_k: int, local_experts: int, block_m: int) -> str | None:
    if logits.ndim != 2 or logits.dtype not in (jnp.float32, jnp.bfloat16):
        return f"logits must be float32 or bfloat16 [tokens, experts], got {logits.dtype} {logits.shape}"
    if not 1 <= top_k <= min(MOE_ROUTE_MAX_TOP_K, logits.shape[1]):
        return f"top_k must be in [1, min({MOE_ROUTE_MAX_TOP_K}, experts {logits.shape[1]})], got {top_k}"
    if not 1 <= local_experts <= logits.shape[1]:
        return f"local_experts must be in [1, experts {logits.shape[1]}], got {local_experts}"
    if block_m < 1 or block_m & (block_m - 1):
        return f"block_m must be a power of two (the plan's scan shifts), got {block_m}"
    return None


def moe_route(logits, num_live, expert_base, *, top_k: int, renormalize: bool, local_experts: int,
              block_m: int) -> MoeRouting:
    """A MoE layer's routing in one launch (two past 128 tokens): the router logits [T, E] (f32 or bf16) to each
    token's top_k experts, their weights and the grouped GEMM's plan of the pairs routed to the local experts
    expert_base[0] ... + local_experts - 1 (tokens from num_live[0] on route nowhere, weight 0). Rows within a group come in
    no fixed order. Without the library, or past MOE_ROUTE_MAX_EXPERTS experts, it runs moe_route_reference."""
    if why := moe_route_unsupported(logits, top_k, local_experts, block_m):
        raise ValueError(f"moe_route: {why}")
    options = {"top_k": top_k, "renormalize": renormalize, "local_experts": local_experts, "block_m": block_m}
    if not available() or logits.shape[1] > MOE_ROUTE_MAX_EXPERTS:
        return moe_route_reference(logits, num_live, expert_base, **options)
    return call_moe_route(logits, num_live, expert_base, **options)


def call_moe_route(logits, num_live, expert_base, *, top_k: int, renormalize: bool, local_experts: int,
                   block_m: int) -> MoeRouting:
    """The FFI call itself (the library must be registered)."""
    from pallas_kernels import grouped_matmul_mgpu as gmm
    pairs, tiles = logits.shape[0] * top_k, gmm.num_tiles_max(logits.shape[0] * top_k, local_experts, block_m)
    index = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    outs = (jax.ShapeDtypeStruct((logits.shape[0], top_k), jnp.float32), index((gmm.margin_rows(pairs, block_m),)),
            index((tiles,)), index((tiles,)), index((1,)), index((logits.shape[0], top_k)))
    return MoeRouting(*jax.ffi.ffi_call("jaxserve_moe_route", outs)(
        logits, num_live.astype(jnp.int32), expert_base.astype(jnp.int32), top_k=np.int32(top_k),
        renormalize=np.int32(renormalize), local_experts=np.int32(local_experts), block_m=np.int32(block_m),
        row_align=np.int32(gmm.ROW_ALIGN)))
