"""The one attention interface the model calls.

`attend` runs either a dense causal attention over one sequence (the plain full-sequence forward kept for
tests) or, given a paged KV layer and a `PagedAttention` (the step's `AttentionBatch` and the engine's
`AttentionKernels`), scatters the new K/V into the donated cache and runs ragged paged attention over the
flattened batch — its blocks addressed by block tables, or (vattention's contiguous kernels) by each sequence's
row of the cache. A layer of vattention's cross-layer cache (kv_cache.VAttentionCache) is read as the
cache's blocks at that layer: the kernels take the same arrays and block ids, num_layers apart. Model code never
knows which. The engine's kernel choice is resolved here, once. `attend_rotated` takes a fused q/k/v projection's
rows on one NVIDIA GPU and rotates q and k where the cache is written (one CUDA call).
Under tensor parallelism the paged step runs per device on its heads (`paged_attention` under
sharding.per_shard).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import custom_calls
from jaxserve.cache.kv_cache import (from_layer_blocks, is_quantized_kv, layer_blocks, layer_slot_mapping,
                                     quantize_kv, write_kv)
from jaxserve.config import DECODE_ATTENTION, PREFILL_ATTENTION
from jaxserve.sharding import HEADS, KV_CACHE, on_one_device, per_shard
from pallas_kernels.cascade_attention import CascadeGroups, cascade_attention
from pallas_kernels.ragged_paged_attention import (contiguous_ragged_attention, gpu_capability, ragged_paged_attention,
                                                 resolve_impl, triton_serves)
from pallas_kernels.block_tables import identity_block_tables


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class AttentionBatch:
    """Static-shape metadata of one ragged step (decodes first); see pallas_kernels for the semantics."""
    slot_mapping: jax.Array   # [T] flat cache slot of each token; padding -> null block 0
    cu_q_lens: jax.Array      # [S+1]
    kv_lens: jax.Array        # [S] context length including this step's tokens
    block_tables: jax.Array | None   # [S, max_blocks_per_seq]; None under contiguous kernels
    num_seqs: jax.Array       # [1]
    # Static: every row has one query (token i is row i's), so the decode kernel serves the whole step.
    decode_only: bool = field(default=False, metadata=dict(static=True))
    kv_rows: jax.Array | None = None   # [S] contiguous kernels: each batch row's vattention cache row
    cascade: CascadeGroups | None = None   # decode-only steps whose rows share leading blocks (cascade attention)


@dataclass(frozen=True, slots=True)
class AttentionKernels:
    """The kernels of one engine, resolved once from its config; a static argument of the jitted step.
    decode: the kernel of decode-only steps — "pallas" (the one-launch Pallas decode), "cuda" (the custom call)
    or "reference" (no GPU kernel runs here: the CPU custom call where it runs, else pure JAX; decode-only steps
    need no graph of their own).
    decode_backend: the Pallas decode's backend — "auto", "triton" or "mosaic" (pallas_kernels' decode_backend).
    prefill: the GPU kernel of prefill rows — "triton" or "mosaic" (pallas_kernels' prefill_backend).
    blocks_per_row: None (blocks addressed by the batch's block tables) or, for vattention's contiguous kernels,
    the blocks of a cache row: block i of a sequence is kv_slot * blocks_per_row + i.
    cuda_decodes: the decodes the CUDA call's tensor-core kernel serves faster take it (see decode_on_cuda)."""
    decode: str = "reference"
    prefill: str = "triton"
    blocks_per_row: int | None = None
    decode_backend: str = "auto"
    cuda_decodes: bool = False

    @property
    def has_decode_kernel(self) -> bool:
        """Decode-only steps compile to a graph of their own."""
        return self.decode != "reference"


def resolve_attention_kernels(decode_attention: str, prefill_attention: str, head_dim: int,
                              blocks_per_row: int | None = None, cache_dtype=None) -> AttentionKernels:
    """decode_attention "auto" takes the Pallas launch where it runs over a cache of cache_dtype, on the backend
    pallas_kernels picks, but on sm_90 for the decodes the CUDA call's tensor-core kernel serves faster (see
    decode_on_cuda); "triton" and "mosaic" name the backend, "cuda" forces the call; each an error naming why when
    it cannot run. A bad name is an error naming the knob. blocks_per_row: see AttentionKernels."""
    if decode_attention not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
    if prefill_attention not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION}, got {prefill_attention!r}")
    if decode_attention == "cuda":
        why = (f"head_dim {head_dim} not in {custom_calls.HEAD_DIMS}" if head_dim not in custom_calls.HEAD_DIMS
               else custom_calls.unavailable_reason())
        if why:
            raise ValueError(f"decode_attention='cuda' but the CUDA custom calls are unavailable: {why}")
        return AttentionKernels("cuda", prefill_attention, blocks_per_row)
    pallas = resolve_impl("auto", interpret=False, cache_dtype=cache_dtype) == "pallas"
    if decode_attention == "mosaic" and gpu_capability() != 9.0:
        raise ValueError("decode_attention='mosaic' needs an sm_90 GPU (H100/H200); this device has compute "
                         f"capability {gpu_capability() or 'none'}: set decode_attention to 'auto'")
    # "triton" is refused where this JAX has no Triton backend; "auto" then takes Mosaic GPU's kernels where they
    # serve and the reference elsewhere (pallas_kernels)
    triton_serves(decode_attention=decode_attention, prefill_attention=prefill_attention)
    if decode_attention == "triton" and not pallas:
        raise ValueError("decode_attention='triton' needs an NVIDIA GPU whose Pallas kernels read this cache "
                         f"(sm_80+, sm_89+ for fp8); this device has compute capability {gpu_capability() or 'none'}"
                         ": set decode_attention to 'auto'")
    backend = decode_attention if decode_attention in ("triton", "mosaic") else "auto"
    cuda_decodes = decode_attention == "auto" and pallas and gpu_capability() == 9.0 and custom_calls.available()
    return AttentionKernels("pallas" if pallas else "reference", prefill_attention, blocks_per_row, backend,
                            cuda_decodes)


@dataclass(frozen=True, slots=True)
class PagedAttention:
    """What the model's layers pass to `attend` in a paged step: the step's batch, the engine's kernels and the
    mesh its weights and cache are split over."""
    batch: AttentionBatch
    kernels: AttentionKernels
    mesh: Mesh


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


@jax.named_scope("attend")
def attend(q, k, v, positions, kv_layer, paged: PagedAttention | None, *, sm_scale: float,
           sliding_window: int | None = None, kv_scales: tuple[jax.Array, jax.Array] | None = None):
    """Returns (out [T, Hq, D], updated kv_layer).

    An FP8 cache stores k / k_scale and v / v_scale (kv_scales: each [Hkv], per kv head). The kernels then read
    the cache as it is: q is multiplied by k_scale before them (q . k = (q * k_scale) . k_stored) and the output
    by v_scale after them (sum p v = v_scale * sum p v_stored), so no kernel handles a scale.

    Paged, over a "tp" mesh: each device writes and attends with its own heads — q and the output split on q
    heads, the new k/v and the cache on kv heads, the batch metadata whole — and o_proj's row-parallel matmul
    then all-reduces. The model's q heads must split evenly (sharding.check_tensor_parallel). When tp
    exceeds the kv heads, the cache holds each kv head once per shard whose q heads use it
    (sharding.cache_kv_heads), so k/v (from replicated projections) are repeated to the cache's heads first."""
    if kv_layer is None:
        return dense_causal_attention(q, k, v, positions, sm_scale=sm_scale, sliding_window=sliding_window), None
    cache = layer_blocks(kv_layer)[0]
    quantized = is_quantized_kv(cache.dtype)
    if quantized:
        k_scale, v_scale = kv_scales
        k, v = quantize_kv(k, k_scale, cache.dtype), quantize_kv(v, v_scale, cache.dtype)
        q = (q * per_q_head(k_scale, q.shape[1])).astype(q.dtype)
    if (repeat := cache.shape[2] // k.shape[1]) > 1:
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
    step = functools.partial(paged_attention, kernels=paged.kernels, sm_scale=sm_scale, sliding_window=sliding_window)
    out, kv_layer = per_shard(step, paged.mesh, (HEADS, HEADS, HEADS, KV_CACHE, P()), (HEADS, KV_CACHE))(
        q, k, v, kv_layer, paged.batch)
    return ((out * per_q_head(v_scale, q.shape[1])).astype(out.dtype) if quantized else out), kv_layer


def per_q_head(scale: jax.Array, num_q_heads: int) -> jax.Array:
    """A per kv head scale [Hkv] broadcast over q heads [1, Hq, 1] (q head h reads kv head h // group)."""
    return jnp.repeat(scale, num_q_heads // scale.shape[0])[None, :, None]


def paged_attention(q, k, v, kv_layer, batch: AttentionBatch, *, kernels: AttentionKernels, sm_scale: float,
                    sliding_window: int | None):
    """Write the new k/v into the donated kv_layer, then attend over the pages: (out, kv_layer)."""
    k_cache, v_cache, num_layers, layer = layer_blocks(kv_layer)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v,
                                layer_slot_mapping(batch.slot_mapping, k_cache.shape[1], num_layers, layer),
                                cross_layer=num_layers > 1)
    out = attend_pages(q, k_cache, v_cache, batch, kernels, num_layers, layer, sm_scale=sm_scale,
                       sliding_window=sliding_window)
    return out, from_layer_blocks(kv_layer, k_cache, v_cache)


def attend_pages(q, k_cache, v_cache, batch: AttentionBatch, kernels: AttentionKernels, num_layers: int, layer,
                 **kw):
    """Attention over the cache, the step's k/v already written. A mixed step's leading decodes, and a cascade
    step's own keys, take the CUDA call where a decode-only step would (pallas_kernels' decode_rows and
    own_partials: where Mosaic GPU's kernels serve the rest)."""
    on_cuda = decode_on_cuda(q, k_cache, batch, kernels)
    if batch.cascade is not None:   # paged, no window (step_graphs.cascade_rule)
        return cascade_attention(q, k_cache, v_cache, batch.kv_lens,
                                 layer_block_ids(batch.block_tables, num_layers, layer), batch.num_seqs, batch.cascade,
                                 sm_scale=kw["sm_scale"], decode_backend=kernels.decode_backend,
                                 own_partials=custom_calls.paged_decode_partials if on_cuda else None)
    if batch.decode_only and on_cuda:
        return cuda_decode(q, k_cache, v_cache, batch, kernels, num_layers, layer, **kw)
    decode_rows = cuda_decode_rows(k_cache, v_cache, batch, kernels, num_layers, layer, **kw) if on_cuda else None
    return ragged_attention(q, k_cache, v_cache, batch, kernels, num_layers, layer, decode_rows=decode_rows, **kw)


def rotates_where_written(qkv, num_q_heads: int, kv_layer, paged: PagedAttention | None) -> bool:
    """Whether attend_rotated takes this step's fused q/k/v rows: a paged step on one NVIDIA GPU whose cache
    (the model's kv heads) and rows the CUDA call takes (custom_calls.rope_and_cache_unsupported)."""
    if kv_layer is None or paged is None or not on_one_device() or not custom_calls.available():
        return False
    k_cache, v_cache = layer_blocks(kv_layer)[:2]
    return custom_calls.rope_and_cache_unsupported(k_cache, v_cache, qkv, num_q_heads) is None


def attend_rotated(qkv, positions, kv_layer, paged: PagedAttention, rotary: custom_calls.Rotary, num_q_heads: int,
                   *, sm_scale: float, sliding_window: int | None = None,
                   kv_scales: tuple[jax.Array, jax.Array] | None = None):
    """attend, for a fused q/k/v projection's rows qkv [T, (Hq + 2 Hkv) D] where rotates_where_written: q's and k's
    heads normed and rotated, k and v written (an FP8 cache's scales applied as attend applies them) in one CUDA
    call (custom_calls.rope_and_cache) where XLA would run three kernels, then attention over the pages."""
    k_cache, v_cache, num_layers, layer = layer_blocks(kv_layer)
    quantized = is_quantized_kv(k_cache.dtype)
    slots = layer_slot_mapping(paged.batch.slot_mapping, k_cache.shape[1], num_layers, layer)
    q, k_cache, v_cache = custom_calls.rope_and_cache(k_cache, v_cache, qkv, positions, slots, rotary, num_q_heads,
                                                      *(kv_scales if quantized else (None, None)))
    out = attend_pages(q, k_cache, v_cache, paged.batch, paged.kernels, num_layers, layer, sm_scale=sm_scale,
                       sliding_window=sliding_window)
    out = (out * per_q_head(kv_scales[1], num_q_heads)).astype(out.dtype) if quantized else out
    return out, from_layer_blocks(kv_layer, k_cache, v_cache)


# Rows from which the CUDA call's tensor-core kernel serves a cache of q's dtype (kernels.cuda_decodes): on the H200
# it takes 0.92-0.99x the Triton decode's time at 256 rows (256-1,152 keys), where the Mosaic GPU decode takes
# 1.02-1.07x; at 64 x 512 1.12x, Mosaic GPU's 1.06x (NOTES_cuda.md, NOTES_attention.md). Over an FP8 cache it is the
# fastest at every row count (0.71-0.82x Triton's time at 256 rows, 0.74x at 8 x 512, 1.02x at 64 x 512 and
# 8 x 4,096; Mosaic GPU's 1.5-2x).
CUDA_DECODE_MIN_ROWS = 256


def decode_on_cuda(q, k_cache, batch: AttentionBatch, kernels: AttentionKernels) -> bool:
    """Whether a step's decodes run the CUDA call: a decode-only step's when asked for, or (kernels.cuda_decodes) any
    step's whose cache and shapes the tensor-core kernel takes, over a cache of q's dtype from CUDA_DECODE_MIN_ROWS
    rows (the batch's sequence slots); a cascade step's, its rows' own keys."""
    if kernels.decode == "cuda":
        return batch.decode_only
    rows = min(q.shape[0], batch.kv_lens.shape[0])
    return (kernels.cuda_decodes and (is_quantized_kv(k_cache.dtype) or rows >= CUDA_DECODE_MIN_ROWS)
            and custom_calls.tensor_core_decode_takes(q.dtype, k_cache.dtype, q.shape[2],
                                                      q.shape[1] // k_cache.shape[2], k_cache.shape[1]))


def ragged_attention(q, k_cache, v_cache, batch: AttentionBatch, kernels: AttentionKernels, num_layers: int, layer,
                     decode_rows=None, **kw):
    """The Pallas launches (the CPU kernel or pure JAX off the GPU) over the batch's block tables or, under
    contiguous kernels, its cache rows; the cache's blocks at `layer` of num_layers (see the module)."""
    kw.update(prefill_backend=kernels.prefill, decode_backend=kernels.decode_backend, decode_only=batch.decode_only,
              decode_rows=decode_rows)
    lens = (q, k_cache, v_cache, batch.cu_q_lens, batch.kv_lens)
    if kernels.blocks_per_row is None:
        return ragged_paged_attention(*lens, layer_block_ids(batch.block_tables, num_layers, layer), batch.num_seqs,
                                      **kw)
    return contiguous_ragged_attention(*lens, batch.kv_rows, batch.num_seqs, blocks_per_row=kernels.blocks_per_row,
                                       num_layers=num_layers, layer=layer, **kw)


def cuda_decode(q, k_cache, v_cache, batch: AttentionBatch, kernels: AttentionKernels, num_layers: int, layer,
                **kw):
    """Decode-only batch: token i is row i's query; padding rows have kv_len 0 and come out as zeros. The custom
    call takes block tables: under contiguous kernels, the rows' identity tables, built in the graph (the call
    reads only each row's first kv_len keys)."""
    num_tokens, num_rows = q.shape[0], batch.kv_lens.shape[0]
    q_rows = q[:num_rows] if num_tokens >= num_rows else jnp.pad(q, ((0, num_rows - num_tokens), (0, 0), (0, 0)))
    tables = (layer_block_ids(batch.block_tables, num_layers, layer) if kernels.blocks_per_row is None
              else identity_block_tables(batch.kv_rows, kernels.blocks_per_row, num_layers, layer))
    out = custom_calls.paged_decode_attention(q_rows, k_cache, v_cache, batch.kv_lens, tables, **kw)
    return out[:num_tokens] if num_rows >= num_tokens else jnp.pad(out, ((0, num_tokens - num_rows), (0, 0), (0, 0)))


def cuda_decode_rows(k_cache, v_cache, batch: AttentionBatch, kernels: AttentionKernels, num_layers: int, layer,
                     **kw):
    """A mixed step's leading decodes through the CUDA call (pallas_kernels' decode_rows): the rows past them get
    kv_len 0, so the call reads nothing for them and writes zeros."""
    def decode_rows(q_rows, num_decodes):
        live = jnp.arange(batch.kv_lens.shape[0]) < num_decodes
        decodes = replace(batch, kv_lens=jnp.where(live, batch.kv_lens, 0), decode_only=True)
        return cuda_decode(q_rows, k_cache, v_cache, decodes, kernels, num_layers, layer, **kw)
    return decode_rows


def layer_block_ids(block_tables, num_layers: int, layer):
    """Block ids of a cross-layer cache's blocks (vattention's identity tables) at `layer`; as they are for a
    per-layer cache."""
    return block_tables if num_layers == 1 else block_tables * num_layers + layer
