"""Cascade attention: a decode-only batch whose sequences share leading KV blocks (a system prompt, n > 1 samples)
reads each shared prefix once per group, not once per sequence.

The rows of group g share their first `shared_lens[g]` keys: the same block ids (the prefix cache's shared,
full blocks) at the start of every member's block table. Two launches:
1. shared pass, grid (kv_heads, member tiles, splits): a tile packs `block_q` members x the q heads of one kv head
   (the prefill kernel's GQA packing, its queries gathered through `rows`), reads its split of the group's shared
   blocks once for all of them and writes float32 partials with their log2-sum-exp. The splits (split-K) keep
   one program from walking a long prefix alone while the GPU idles: `Tuning.cascade_programs` shared out over
   a full batch's tiles;
2. the one-launch decode kernel over each row's own keys [kv_starts[i], kv_len), starting from the shared pass's
   partials, merged, as its online-softmax state: the merge is exact (log-sum-exp) and needs no launch of its own.
Rows outside every group (kv_starts 0) run as plain decode. No sliding window: a windowed prefix would read only
part of the shared keys per row, which one multi-query pass over them does not express.
"""
import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import init_carry, interpret_params
from pallas_kernels.ragged_paged_attention import (PagedKV, Scores, Geometry, attend_range, attend_tile,
                                                   check_inputs, check_pallas_inputs, decode_on_mosaic, load_q,
                                                   locate_block, make_tuning, one_launch_decode, plgpu,
                                                   resolve_impl, store_partials, triton_in_auto, triton_serves)
from pallas_kernels.ragged_paged_attention_reference import cascade_attention_reference


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class CascadeGroups:
    """Decode rows grouped by a shared run of leading blocks; static shapes: S rows, G groups."""
    kv_starts: jax.Array    # [S] first key of each row's own keys: its group's shared length, 0 outside groups
    rows: jax.Array         # [S] rows by group: group g's members are rows[cu_rows[g]:cu_rows[g + 1]]
    cu_rows: jax.Array      # [G + 1]
    shared_lens: jax.Array  # [G] shared keys of each group (whole blocks, before every member's newest token)
    table_rows: jax.Array   # [G] a member of each group: its block table row holds the shared blocks
    num_groups: jax.Array   # [1]


def cascade_attention(q, k_cache, v_cache, kv_lens, block_tables, num_seqs, groups: CascadeGroups, *,
                      sm_scale: float, soft_cap: float | None = None, impl: str = "auto", decode_backend: str = "auto",
                      interpret: bool = False, own_partials=None, **tuning) -> jax.Array:
    """`ragged_paged_attention(..., decode_only=True)` (token i is row i's query) over a batch whose rows may share
    leading blocks as `groups` says; the same output. impl: as ragged_paged_attention's but "cpu" (no CPU kernel here:
    "auto" runs the reference on a CPU); "reference" is pure JAX. decode_backend="mosaic" (and "auto" where it
    takes the Mosaic GPU decode: on Hopper): both passes on that kernel (`cascade_attention_mgpu`), the rows' own
    keys through `own_partials` where given (its seam: the engine's CUDA call); else these Triton launches, or the
    reference under a JAX without Pallas's Triton backend."""
    num_rows = kv_lens.shape[0]
    cu_q_lens = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), jnp.reshape(num_seqs, ()))
    num_seqs = check_inputs(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, None, num_seqs, sm_scale, None,
                            soft_cap, impl, "auto", decode_backend=decode_backend)
    check_groups(groups, num_rows)
    scores = Scores(float(sm_scale), None, None if soft_cap is None else float(soft_cap))
    if impl == "cpu":
        raise ValueError("cascade attention has no CPU kernel: impl='auto' or 'reference' runs it on a CPU")
    pallas = resolve_impl(impl, interpret, k_cache.dtype) == "pallas"
    if pallas and not triton_in_auto(interpret) and decode_backend == "auto":   # Mosaic GPU's where it serves
        on_mosaic = decode_on_mosaic(q, k_cache, make_tuning(q.dtype, tuning, k_cache.dtype), "auto", interpret)
        decode_backend = "mosaic" if on_mosaic is not None else decode_backend
    if not pallas or (decode_backend != "mosaic" and not triton_serves(decode_backend=decode_backend)):
        if tuning and not pallas:
            raise ValueError(f"tuning {sorted(tuning)} applies to impl='pallas' only")
        return cascade_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, num_seqs, groups,
                                           sm_scale=scores.sm_scale, soft_cap=scores.soft_cap)
    check_pallas_inputs(q, k_cache, interpret)
    if decode_backend == "mosaic":   # jitted as pallas_kernels' Mosaic GPU launches are, and why
        run = mosaic_cascade if interpret else pallas_mosaic_cascade
        return run(q, k_cache, v_cache, kv_lens, block_tables, num_seqs, groups, scores=scores,
                   tuning=make_tuning(q.dtype, tuning, k_cache.dtype), interpret=interpret, own_partials=own_partials)
    return pallas_cascade(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, groups, scores=scores,
                          tuning=make_tuning(q.dtype, tuning, k_cache.dtype), interpret=interpret)


def mosaic_cascade(q, k_cache, v_cache, kv_lens, block_tables, num_seqs, groups: CascadeGroups, *, scores: Scores,
                   tuning, interpret: bool, own_partials=None):
    from pallas_kernels.cascade_attention_mgpu import cascade_decode_attention   # Mosaic GPU's import: where it runs
    decode = decode_on_mosaic(q, k_cache, tuning, "mosaic", interpret)
    return cascade_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, jnp.reshape(num_seqs, ()), groups,
                                    sm_scale=scores.sm_scale, soft_cap=scores.soft_cap, tuning=decode,
                                    interpret=interpret, own_partials=own_partials)


pallas_mosaic_cascade = jax.jit(mosaic_cascade, static_argnames=("scores", "tuning", "interpret", "own_partials"))


def check_groups(groups: CascadeGroups, num_rows: int) -> None:
    num_groups = groups.shared_lens.shape[0]
    shapes = {"kv_starts": (num_rows,), "rows": (num_rows,), "cu_rows": (num_groups + 1,),
              "table_rows": (num_groups,), "num_groups": (1,)}
    for name, shape in shapes.items():
        x = getattr(groups, name)
        if x.shape != shape or x.dtype != jnp.int32:
            raise ValueError(f"groups.{name} must be int32 {list(shape)} ({num_rows} rows, {num_groups} groups), "
                             f"got {x.dtype}{list(x.shape)}")


@functools.partial(jax.jit, static_argnames=("scores", "tuning", "interpret"))
def pallas_cascade(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, groups: CascadeGroups, *,
                   scores: Scores, tuning, interpret: bool):
    geo = Geometry.of(q, k_cache, block_tables, None)
    rows = (q.reshape(-1, geo.head_dim), k_cache.reshape(-1, geo.head_dim), v_cache.reshape(-1, geo.head_dim))
    parts, lse = shared_pass_call(geo, groups.shared_lens.shape[0], scores, tuning, interpret)(
        groups.num_groups, groups.cu_rows, groups.shared_lens, groups.table_rows, groups.rows,
        block_tables.reshape(-1), *rows)
    return one_launch_decode(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, scores=scores,
                             tuning=tuning, interpret=interpret, prefix=(groups.kv_starts, parts, lse))


def shared_pass_call(geo: Geometry, num_groups: int, scores: Scores, tuning, interpret: bool):
    block_q = tuning.prefill_block_m // geo.group_pad
    # groups as the prefill kernel's sequences, their members as its tokens: every group may end mid-tile
    groups_geo = dataclasses.replace(geo, num_tokens=geo.max_seqs, max_seqs=num_groups)
    num_tiles = geo.max_seqs // block_q + num_groups + 1
    splits = shared_splits(geo, block_q, tuning)
    kernel = functools.partial(shared_pass_kernel, geo=geo, groups_geo=groups_geo, scores=scores, block_q=block_q,
                               splits=splits, tile=max(tuning.prefill_kv_tile, geo.block_size))
    rows = splits * geo.num_tokens * geo.num_q_heads
    return pl.pallas_call(
        kernel, grid=(geo.num_kv_heads, num_tiles, splits),
        out_shape=(jax.ShapeDtypeStruct((rows, geo.head_dim), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.prefill_num_warps,
                                             num_stages=tuning.prefill_num_stages),
        interpret=interpret_params(interpret), name="cascade_attention_shared_pass")


def shared_splits(geo: Geometry, block_q: int, tuning) -> int:
    """Splits of the shared keys: `cascade_programs` over the member tiles of a full batch (fixed by the shape,
    so the decode launch knows how many partials to merge), at most `decode_max_splits`."""
    tiles = geo.num_kv_heads * pl.cdiv(geo.max_seqs, block_q)
    return max(1, min(tuning.cascade_programs // tiles, tuning.decode_max_splits))


def shared_pass_kernel(num_groups_ref, cu_ref, *refs, block_q, **static):
    """`block_q` members of one group x the q heads of one kv head over split `program_id(2)` of the group's shared
    keys (`attend_shared`)."""
    num_groups = num_groups_ref[0]
    kv_head, tile_id, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # the grid has room for every group ending mid-tile at a full batch; programs past the live groups' tiles
    # leave at once (two scalar loads), or an idle grid costs more than the shared keys save
    live_tiles = cu_ref[num_groups] // block_q + num_groups + 1
    pl.when(tile_id < live_tiles)(
        lambda: attend_shared(kv_head, tile_id, split, num_groups, cu_ref, *refs, block_q=block_q, **static))


def attend_shared(kv_head, tile_id, split, num_groups, cu_ref, lens_ref, table_rows_ref, rows_ref, blocks_ref,
                  q_ref, k_ref, v_ref, parts_ref, lse_ref, *, geo, groups_geo, scores, block_q, splits, tile):
    """Every key visible to every row; rows of no member are left unwritten (the decode launch reads only
    members'). Every split writes its partial, an empty one as zeros of log2-sum-exp -inf (weight 0)."""
    group, first, members, t0 = locate_block(cu_ref, num_groups, tile_id, groups_geo, block_q)
    active = (group < num_groups) & (t0 < members)
    g = jnp.minimum(group, groups_geo.max_seqs - 1)
    shared = jnp.where(active, lens_ref[g], 0)
    r = jnp.arange(block_q * geo.group_pad)
    member, head = t0 + r // geo.group_pad, r % geo.group_pad
    ok = active & (member < members) & (head < geo.group)
    token = plgpu.load(rows_ref.at[jnp.where(ok, first + member, 0)], mask=ok, other=0)
    q_row = token * geo.num_q_heads + kv_head * geo.group + head
    q = load_q(q_ref, q_row, ok, k_ref.dtype)
    cache = PagedKV(geo.addressing(blocks_ref), k_ref, v_ref)
    step = functools.partial(attend_tile, q=q, q_pos=jnp.full(r.shape, shared - 1),
                             seq_blocks=cache.blocks.of(table_rows_ref[g], geo), kv_len=shared, kv_head=kv_head,
                             cache=cache, geo=geo, scores=scores, tile=tile)
    num = pl.cdiv(shared, tile)
    per_split = pl.cdiv(num, splits)
    lo = jnp.minimum(split * per_split, num)
    acc, m, l = attend_range(init_carry(q.shape), lo, jnp.minimum(lo + per_split, num), 0, shared // tile, step)
    store_partials(parts_ref, lse_ref, split * geo.num_tokens * geo.num_q_heads + q_row, ok, acc, m, l)
