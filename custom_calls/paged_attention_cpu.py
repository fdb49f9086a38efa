"""Ragged paged attention on the CPU through an XLA FFI custom call (`csrc/paged_attention_cpu.cc`, AVX2):
`pallas_kernels.ragged_paged_attention`'s contract (a mixed batch of chunked prefills and decodes, GQA, sliding
window, soft cap) over a cache of f32, bf16, f16 or e4m3 (also as its bits, uint8, as the engine keeps an fp8 cache
on a CPU). Each token walks only the keys it sees, a block at a time where they lie, with an online softmax in f32;
the pure-JAX reference beside the Pallas kernel (`ragged_paged_attention_reference`) gathers blocks into fresh
arrays for every token on every loop trip, a decode step's attention costing ~140 us a layer on a CPU at 45 tokens
of context. `pallas_kernels.ragged_paged_attention` takes this kernel (impl "auto") where it runs."""
import jax
import jax.numpy as jnp
import numpy as np

from custom_calls import cpu

TARGET = "jaxserve_ragged_paged_attention_cpu"
CACHE_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.uint8)))
LANES = 8   # head_dim a multiple of this: the kernel reads a key in AVX vectors of 8 floats


def unsupported(cache_dtype, head_dim: int) -> str | None:
    """Why the kernel cannot serve a cache of this dtype and head_dim here (None: it can)."""
    if (reason := cpu.unavailable_reason()) is not None:
        return reason
    if jnp.dtype(cache_dtype) not in CACHE_DTYPES:
        return f"its caches are {', '.join(d.name for d in CACHE_DTYPES)}, not {jnp.dtype(cache_dtype).name}"
    if head_dim % LANES:
        return f"head_dim must be a multiple of {LANES}, got {head_dim}"
    return None


def ragged_paged_attention_cpu(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
    """As `ragged_paged_attention_reference` (same arguments; computes in f32, returns q's dtype). The caller checks
    `unsupported` first; inputs are validated by `ragged_paged_attention`'s checks."""
    index = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, index(cu_q_lens), index(kv_lens), index(block_tables),
        jnp.reshape(index(num_seqs), (1,)), sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
