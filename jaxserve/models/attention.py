"""The one attention interface the model calls.

`attend` runs either a dense causal attention over one sequence (the plain full-sequence forward kept for
tests) or, given a paged KV layer and an `AttentionBatch`, scatters the new K/V into the donated cache and
runs ragged paged attention over the flattened batch. Model code never knows which.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

import custom_calls
from jaxserve.cache.kv_cache import write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention



@jax.tree_util.register_dataclass
@dataclass(slots=True)
class AttentionBatch:
    """Static-shape metadata of one ragged step (decodes first); see pallas_kernels for the semantics."""
    slot_mapping: jax.Array   # [T] flat cache slot of each token; padding -> null block 0
    cu_q_lens: jax.Array      # [S+1]
    kv_lens: jax.Array        # [S] context length including this step's tokens
    block_tables: jax.Array   # [S, max_blocks_per_seq]
    num_seqs: jax.Array       # [1]
    # Static, for a decode-only batch (one token per row, rows == tokens): "one_launch" (the Pallas decode-only
    # launch) or "cuda" (the CUDA custom call); "ragged" (any batch): the mixed-batch kernel.
    decode_impl: str = field(default="ragged", metadata=dict(static=True))
    # Static: the GPU kernel for prefill rows (pallas_kernels.ragged_paged_attention's prefill_backend).
    prefill_backend: str = field(default="triton", metadata=dict(static=True))


def dense_causal_attention(q, k, v, positions, *, sm_scale: float, sliding_window: int | None):
    """Reference attention over one sequence: q [T, Hq, D], k/v [T, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    allowed = positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        allowed &= positions[None, :] > positions[:, None] - sliding_window
    p = jax.nn.softmax(jnp.where(allowed[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def attend(q, k, v, positions, kv_layer, batch: AttentionBatch | None, *, sm_scale: float,
           sliding_window: int | None = None):
    """Returns (out [T, Hq, D], updated kv_layer)."""
    if kv_layer is None:
        return dense_causal_attention(q, k, v, positions, sm_scale=sm_scale, sliding_window=sliding_window), None
    k_cache, v_cache = write_kv(*kv_layer, k, v, batch.slot_mapping)
    if batch.decode_impl == "cuda":
        out = cuda_decode(q, k_cache, v_cache, batch, sm_scale=sm_scale, sliding_window=sliding_window)
    else:
        out = ragged_paged_attention(q, k_cache, v_cache, batch.cu_q_lens, batch.kv_lens, batch.block_tables,
                                     batch.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                     prefill_backend=batch.prefill_backend,
                                     decode_only=batch.decode_impl == "one_launch")
    return out, (k_cache, v_cache)


def cuda_decode(q, k_cache, v_cache, batch: AttentionBatch, **kw):
    """Decode-only batch: token i is row i's query; padding rows have kv_len 0 and come out as zeros."""
    num_tokens, num_rows = q.shape[0], batch.kv_lens.shape[0]
    q_rows = q[:num_rows] if num_tokens >= num_rows else jnp.pad(q, ((0, num_rows - num_tokens), (0, 0), (0, 0)))
    out = custom_calls.paged_decode_attention(q_rows, k_cache, v_cache, batch.kv_lens, batch.block_tables, **kw)
    return out[:num_tokens] if num_rows >= num_tokens else jnp.pad(out, ((0, num_tokens - num_rows), (0, 0), (0, 0)))
