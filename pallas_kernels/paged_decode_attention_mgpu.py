"""Paged decode attention for Hopper (sm_90a): Pallas Mosaic GPU, TMA page copies into wgmma.

The decode-only launch of `ragged_paged_attention` without Pallas's Triton backend: every sequence has one query
(token i is sequence i's), the cache layout and metadata are the ragged kernel's.

- Work items (slot, kv head), slot = sequence * splits + split. `splits` is fixed by the shape (the engine's
  bucket), so a small batch spreads each context over several items (flash-decoding) and every item knows its
  keys from its index. Splits write float32 partials and their log2-sum-exp, merged by one XLA fusion after the
  launch.
- A persistent grid (one CTA per SM) deals the items round-robin: a batch of many short contexts pays the
  pipeline's ramp once per CTA, not once per item, and no wave is left a few CTAs long.
- The q heads of one kv head (GQA) are the first rows of a 64-row wgmma tile, the rest zeros: decode is bound by
  the K/V reads, and the tensor cores' idle rows cost less than moving the dots off them.
- A memory warpgroup TMA-copies each step's pages (block_kv // block_size for K and for V) into a ring
  `max_concurrent_steps` deep, running on into the next item's. `compute_warpgroups` (1 or 2) run QK, the online
  softmax and PV as the pages land, each freeing a slot after its PV. Two take alternate steps of an item, so one's
  chain of dependent latencies (over an fp8 cache: the tiles' conversion, the dots, the softmax) overlaps the
  other's, and are merged by log-sum-exp through SMEM at the item's end.
- Keys past the context (the last step's tail: the null block) are masked and their V rows zeroed, since
  0 x NaN would leak; pages before a sliding window's start are not read.
- FP8 (e4m3) caches are read as their values (any scale is the caller's): each K and V tile is converted in
  registers to float16 into a swizzled tile for wgmma (e4m3 -> bf16 takes a newer PTX than CUDA 13's), and q is
  clipped to float16's range, as the Triton kernels do.
"""
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (FP8_CACHE, LOG2E, as_dot_dtype, log2_logits, merge_carries,
                                   mosaic_interpret_params, normalize, online_softmax_step, per_row)
from pallas_kernels.paged_prefill_attention_mgpu import as_operand, page_addressing, wgmma_carry, zero_rows_from

TILE_ROWS = 64  # wgmma's M: the q heads of a kv head fill the first rows


@dataclass(frozen=True, slots=True)
class DecodeTuning:
    """Defaults tuned on H200 (H100-class: 132 SMs), bf16, head_dim 128."""
    block_kv: int = 64  # keys per pipeline step: a multiple of 64 and of the block size
    max_concurrent_steps: int = 4
    programs: int = 132  # work items a launch aims for: small batches split their contexts until they fill it
    max_splits: int = 16
    num_ctas: int = 132  # persistent grid, one CTA per SM (H100); the caller passes the device's core count
    compute_warpgroups: int = 1  # 2: alternate steps of an item (max_concurrent_steps even), merged at its end;
    # pays over fp8 caches (their tiles' conversion is on the chain), not over bf16 ones


def supported(q, k_cache, tuning: DecodeTuning = DecodeTuning()) -> str | None:
    """None when this kernel can serve the shapes, else why not."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (needs bfloat16/float16)"
    if k_cache.dtype not in (q.dtype, FP8_CACHE):
        return f"KV cache dtype {k_cache.dtype} (needs q's, {q.dtype}, or float8_e4m3fn)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if block_size % 8 or tuning.block_kv % block_size or tuning.block_kv % TILE_ROWS:
        return f"block_size {block_size} (needs a multiple of 8 dividing block_kv={tuning.block_kv})"
    if group > TILE_ROWS:
        return f"{group} q heads per kv head (at most {TILE_ROWS})"
    if tuning.compute_warpgroups not in (1, 2) or tuning.max_concurrent_steps % tuning.compute_warpgroups:
        return (f"compute_warpgroups={tuning.compute_warpgroups} with max_concurrent_steps="
                f"{tuning.max_concurrent_steps} (needs 1, or 2 with an even ring: a slot's steps stay one "
                "warpgroup's)")
    return None


def num_splits(rows: int, kv_heads: int, tuning: DecodeTuning) -> int:
    """Work items per (sequence, kv head): enough for `rows` sequences to fill `tuning.programs`, at most
    max_splits."""
    return max(1, min(pl.cdiv(tuning.programs, kv_heads) // rows, tuning.max_splits))


def paged_decode_attention(q, k_cache, v_cache, kv_lens, blocks, num_decodes, *, sm_scale,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           tuning: DecodeTuning = DecodeTuning(), interpret=False,
                           blocks_per_row: int | None = None, block_stride: int = 1):
    """Token i < num_decodes is decode i (one query at position kv_lens[i] - 1) over its paged keys; other rows
    come out as zeros. q [num_tokens, num_q_heads, head_dim]; blocks: the block table [max_seqs, max_blocks], or
    (blocks_per_row given) each sequence's first block, its row's blocks block_stride apart."""
    num_tokens = q.shape[0]
    options = {"sm_scale": sm_scale, "sliding_window": sliding_window, "soft_cap": soft_cap, "tuning": tuning,
               "interpret": interpret, "blocks_per_row": blocks_per_row, "block_stride": block_stride}
    if num_splits(min(blocks.shape[0], num_tokens), k_cache.shape[2], tuning) == 1:
        return launch(q, k_cache, v_cache, kv_lens, blocks, num_decodes, splits=1, partials=False, **options)
    out, _ = merge_partials(*decode_partials(q, k_cache, v_cache, kv_lens, blocks, num_decodes, **options))
    return jnp.pad(out, ((0, num_tokens - out.shape[0]), (0, 0), (0, 0))).astype(q.dtype)


def decode_partials(q, k_cache, v_cache, kv_lens, blocks, num_decodes, *, tuning: DecodeTuning = DecodeTuning(),
                    **options):
    """paged_decode_attention's decodes as float32 partials to merge (its splits', cascade attention's):
    ([rows, splits, q heads, head_dim] normalised, [rows, splits, q heads] their log2-sum-exps, -inf for no keys),
    rows = min(block table rows, tokens); options: paged_decode_attention's."""
    rows = min(blocks.shape[0], q.shape[0])
    splits = num_splits(rows, k_cache.shape[2], tuning)
    parts, lse = launch(q, k_cache, v_cache, kv_lens, blocks, num_decodes, splits=splits, partials=True,
                        tuning=tuning, **options)
    group = q.shape[1] // lse.shape[1]   # each kv head's first `group` tile rows are its q heads'
    return parts.reshape(rows, splits, *parts.shape[1:]), lse[..., :group].reshape(rows, splits, q.shape[1])


def launch(q, k_cache, v_cache, kv_lens, blocks, num_decodes, *, splits, partials, sm_scale, sliding_window=None,
           soft_cap=None, tuning: DecodeTuning, interpret=False, blocks_per_row=None, block_stride=1):
    """The kernel: its output [num_tokens, q heads, head_dim] in q's dtype, or with `partials` each (decode, split)
    slot's normalised float32 partial [rows * splits, q heads, head_dim] and per kv head a log2-sum-exp per tile row
    [rows * splits, kv heads, TILE_ROWS]."""
    num_tokens, num_q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    slots = min(blocks.shape[0], num_tokens) * splits if partials else num_tokens
    if partials:
        out_type = (jax.ShapeDtypeStruct((slots, num_q_heads, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((slots, kv_heads, TILE_ROWS), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    num_ctas = min(tuning.num_ctas, slots * kv_heads)
    kernel = functools.partial(
        decode_kernel, tuning=tuning, splits=splits, num_ctas=num_ctas, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        blocks_per_row=blocks_per_row, block_stride=block_stride)
    return plgpu.kernel(
        kernel, out_type=out_type,
        scratch_types=(scratch(q.dtype, k_cache.dtype, head_dim, tuning, k_cache.shape[1], partials, interpret),),
        grid=(num_ctas,), grid_names=("cta",), num_threads=tuning.compute_warpgroups + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params(interpret),
    )(jnp.asarray(num_decodes, jnp.int32).reshape(1), kv_lens, q, k_cache, v_cache, blocks)


def merge_partials(parts, lse):
    """Partials [rows, n, heads, head_dim] (normalised) with their log2-sum-exps [rows, n, heads] -> their exact
    merge, float32 [rows, heads, head_dim] (zeros where none has keys), and its log2-sum-exp [rows, heads]."""
    m = lse.max(axis=1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    weights = jnp.exp2(lse - m)
    total = weights.sum(axis=1)
    # elementwise, not a dot: a float32 dot may run in TF32 on the GPU
    out = (weights[..., None] * parts).sum(axis=1) / jnp.where(total == 0, 1.0, total)[..., None]
    return out, jnp.log2(total) + m[:, 0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Ring:
    """K or V pages in SMEM: one buffer per step in flight, and a barrier per buffer its page copies arrive on."""
    buffers: Any  # [max_concurrent_steps, block_kv, head_dim], swizzled for wgmma
    ready: Any


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Scratch:
    q_tile: Any  # [64, head_dim] swizzled: the wgmma operand
    staging: Any  # [2]: item n's q lands in staging[n % 2], and its output leaves from there (plain SMEM: the rows
    # start anywhere in HBM)
    k: Ring
    v: Ring
    free: Any  # per ring slot: its compute warpgroup is done with its K and V
    q_ready: Any  # [2], one per staging buffer
    p_tile: Any  # softmax probabilities for the interpreter's wgmma (SMEM operands only); None on the GPU
    parts: Any  # float32 partial and its log2-sum-exp where the launch gives partials; else None
    lse: Any
    k_tile: Any  # an fp8 cache's K and V tiles converted for wgmma; None when the ring holds q's dtype
    v_tile: Any
    merge: Any  # two compute warpgroups: the second's (acc, m, l) for the first to merge; else None
    q_set: Any  # two: the first wrote the item's q_tile / read the second's partial
    merge_free: Any
    merged: Any  # the second wrote its partial (so is done with q_tile)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Merge:
    acc: Any  # [64, head_dim] float32 (the split partial's buffer where there is one: it is written after)
    m: Any
    l: Any


def scratch(dtype, cache_dtype, head_dim, tuning: DecodeTuning, block_size, partials, interpret) -> Scratch:
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    steps, pages = tuning.max_concurrent_steps, tuning.block_kv // block_size
    wgs = tuning.compute_warpgroups
    fp8 = jnp.dtype(cache_dtype) == FP8_CACHE
    compute = jnp.float16 if fp8 else dtype

    def ring():  # an fp8 ring is only read into registers: plain (swizzled measured no faster)
        return Ring(plgpu.SMEM((steps, tuning.block_kv, head_dim), cache_dtype, transforms=() if fp8 else swizzled),
                    plgpu.Barrier(num_arrivals=pages, num_barriers=steps))

    def per_warpgroup(shape, dtype):
        return plgpu.SMEM((wgs, *shape), dtype, transforms=swizzled)

    def converted():
        return per_warpgroup((tuning.block_kv, head_dim), compute) if fp8 else None

    parts = plgpu.SMEM((TILE_ROWS, head_dim), jnp.float32) if partials else None
    merge, signals = None, (None,) * 3
    if wgs == 2:
        # float32 swizzled (8 x 32 tiles): the accumulator's layout stores and loads it without bank conflicts
        acc = plgpu.SMEM((TILE_ROWS, head_dim), jnp.float32,
                         transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
        merge = Merge(acc if parts is None else None,
                      plgpu.SMEM((TILE_ROWS,), jnp.float32), plgpu.SMEM((TILE_ROWS,), jnp.float32))
        signals = tuple(plgpu.Barrier() for _ in range(3))
    return Scratch(
        q_tile=plgpu.SMEM((TILE_ROWS, head_dim), compute, transforms=swizzled),
        staging=plgpu.SMEM((2, TILE_ROWS, head_dim), dtype),
        k=ring(), v=ring(),
        free=plgpu.Barrier(num_barriers=steps),
        q_ready=plgpu.Barrier(num_barriers=2),
        p_tile=per_warpgroup((TILE_ROWS, tuning.block_kv), compute) if interpret else None,
        parts=parts,
        lse=plgpu.SMEM((TILE_ROWS,), jnp.float32) if partials else None,
        k_tile=converted(), v_tile=converted(),
        merge=merge, q_set=signals[0], merge_free=signals[1], merged=signals[2])


def of_warpgroup(scratch: Scratch, wg: int) -> Scratch:
    """The CTA's scratch as compute warpgroup `wg` uses it: its own converted tiles and interpreter operand."""
    def own(ref):
        return None if ref is None else ref.at[wg]

    merge = scratch.merge
    if merge is not None and merge.acc is None:
        merge = Merge(scratch.parts, merge.m, merge.l)
    return dataclasses.replace(scratch, p_tile=own(scratch.p_tile), k_tile=own(scratch.k_tile),
                               v_tile=own(scratch.v_tile), merge=merge)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Work:
    """One work item: kv head `kv_head` of decode `seq`'s keys [first, kv_len), of which KV steps [lo, hi) are
    this split's; its partial (or output) goes to row `slot`."""
    kv_head: jax.Array
    slot: jax.Array
    seq: jax.Array
    kv_len: jax.Array
    first: jax.Array
    lo: jax.Array
    hi: jax.Array


def locate(n, num_ref, kv_lens_ref, *, kv_heads, num_ctas, splits, block_kv, sliding_window) -> Work:
    """The CTA's n-th work item: items are (slot, kv head) pairs, kv heads fastest, dealt round-robin."""
    w = lax.axis_index("cta") + n * num_ctas
    slot, kv_head = w // kv_heads, w % kv_heads
    seq, split = slot // splits, slot % splits
    kv_len = jnp.where(seq < num_ref[0], kv_lens_ref[jnp.minimum(seq, kv_lens_ref.shape[0] - 1)], 0)
    first = jnp.zeros_like(kv_len) if sliding_window is None else jnp.maximum(kv_len - sliding_window, 0)
    lo, hi = first // block_kv, pl.cdiv(kv_len, block_kv)
    per_split = pl.cdiv(hi - lo, splits)
    lo = jnp.minimum(lo + split * per_split, hi)
    return Work(kv_head, slot, seq, kv_len, first, lo, jnp.minimum(lo + per_split, hi))


def decode_kernel(num_ref, kv_lens_ref, q_ref, k_ref, v_ref, blocks_ref, *refs, tuning, splits, num_ctas, sm_scale,
                  sliding_window, soft_cap, blocks_per_row, block_stride):
    """A persistent CTA: its warpgroups walk the same work items in the same order, the memory warpgroup running
    ahead into the next item's pages while the compute warpgroups finish one."""
    *outs, scratch = refs
    kv_heads = k_ref.shape[2]
    group = q_ref.shape[1] // kv_heads
    num_items = pl.cdiv(outs[0].shape[0] * kv_heads - lax.axis_index("cta"), num_ctas)
    item = functools.partial(locate, num_ref=num_ref, kv_lens_ref=kv_lens_ref, kv_heads=kv_heads, num_ctas=num_ctas,
                             splits=splits, block_kv=tuning.block_kv, sliding_window=sliding_window)
    attend_item = functools.partial(attend, tuning=tuning, sm_scale=sm_scale, soft_cap=soft_cap)
    wg, wgs = lax.axis_index("wg"), tuning.compute_warpgroups

    @pl.when(wg == 0)
    def _():
        plgpu.set_max_registers(232, action="increase")
        own = of_warpgroup(scratch, 0)

        def one(n, carry):
            step, work = carry
            nxt = item(n + 1)  # its length loads now, its q once this item's q is in place
            buffer, more = n % 2, n + 1 < num_items
            pl.when(more)(lambda: load_q(nxt, 1 - buffer, q_ref, scratch, group))
            acc, m, l = attend_item(work, step, own, 0)
            if wgs == 2:  # the second is done with q_tile once its partial is written
                plgpu.barrier_wait(scratch.merged)
            pl.when(more)(lambda: set_q_tile(scratch, 1 - buffer))
            if wgs == 2:
                acc, m, l = merge_carries((acc, m, l), read_partial(own.merge))
            store(work, acc, m, l, outs, scratch, group, scratch.staging.at[buffer])
            if wgs == 2:  # after the store: a split's partial leaves through the merge buffer
                plgpu.barrier_arrive(scratch.merge_free)
            return step + work.hi - work.lo, nxt

        @pl.when(num_items > 0)
        def _():
            load_q(item(0), 0, q_ref, scratch, group)
            set_q_tile(scratch, 0)

        lax.fori_loop(0, num_items, one, (0, item(0)))

    if wgs == 2:
        @pl.when(wg == 1)
        def _():
            plgpu.set_max_registers(232, action="increase")
            own = of_warpgroup(scratch, 1)

            def one(n, carry):
                step, work = carry
                plgpu.barrier_wait(scratch.q_set)
                partial = attend_item(work, step, own, 1)
                pl.when(n > 0)(lambda: plgpu.barrier_wait(scratch.merge_free))
                write_partial(own.merge, *partial)
                plgpu.barrier_arrive(scratch.merged)
                return step + work.hi - work.lo, item(n + 1)

            lax.fori_loop(0, num_items, one, (0, item(0)))
            pl.when(num_items > 0)(lambda: plgpu.barrier_wait(scratch.merge_free))  # the last item's

    @pl.when(wg == wgs)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        pages = page_addressing(blocks_ref, blocks_per_row, block_stride)
        steps = lax.fori_loop(0, num_items, lambda n, step: stream(item(n), step, k_ref, v_ref, pages, scratch,
                                                                   tuning), 0)
        depth = tuning.max_concurrent_steps
        for i in range(depth):  # observe the last releases before the barriers go
            last = steps - depth + i
            pl.when(last >= 0)(lambda: plgpu.barrier_wait(scratch.free.at[last % depth]))


def set_q_tile(scratch: Scratch, buffer):
    """q_tile from staging[buffer] once its q landed; the second compute warpgroup is told."""
    plgpu.barrier_wait(scratch.q_ready.at[buffer])
    # rows past the group: leftovers, harmless: wgmma's rows are independent and only the group's are stored
    scratch.q_tile[...] = as_dot_dtype(scratch.staging[buffer], scratch.q_tile.dtype)
    plgpu.commit_smem()
    if scratch.q_set is not None:
        plgpu.barrier_arrive(scratch.q_set)


def write_partial(merge: Merge, acc, m, l):
    merge.acc[...] = acc
    merge.m[...] = m
    merge.l[...] = l
    plgpu.commit_smem()


def read_partial(merge: Merge):
    row = plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.load(merge.acc, layout=plgpu.Layout.WGMMA, optimized=False),
            plgpu.load(merge.m, layout=row, optimized=False), plgpu.load(merge.l, layout=row, optimized=False))


def stream(work: Work, step, k_ref, v_ref, pages, scratch: Scratch, tuning: DecodeTuning):
    """Memory warpgroup: the pages of the item's steps [lo, hi) into the ring, each slot reused once its PV is
    done; returns the running step count."""
    block_size = k_ref.shape[1]
    per_step, depth = tuning.block_kv // block_size, tuning.max_concurrent_steps
    seq_pages = pages.of(jnp.minimum(work.seq, pages.ref.shape[0] - 1))

    def one(s, step):
        slot = step % depth
        # pages past the context may not be in the table: the null block stands in (its V rows are zeroed)
        ids = [jnp.where((s * per_step + i) * block_size < work.kv_len, pages.page(seq_pages, s * per_step + i), 0)
               for i in range(per_step)]
        pl.when(step >= depth)(lambda: plgpu.barrier_wait(scratch.free.at[slot]))
        for ring, cache in ((scratch.k, k_ref), (scratch.v, v_ref)):
            for i, page in enumerate(ids):
                plgpu.copy_gmem_to_smem(cache.at[page, :, work.kv_head],
                                        ring.buffers.at[slot, pl.ds(i * block_size, block_size)],
                                        ring.ready.at[slot])
        return step + 1

    return lax.fori_loop(work.lo, work.hi, one, step)


def load_q(work: Work, buffer, q_ref, scratch: Scratch, group):
    """The item's q heads into staging[buffer] (rows [0, group)), by TMA."""
    token = jnp.minimum(work.seq, q_ref.shape[0] - 1)
    plgpu.copy_gmem_to_smem(q_ref.at[token, pl.ds(work.kv_head * group, group)],
                            scratch.staging.at[buffer, pl.ds(0, group)], scratch.q_ready.at[buffer])


def attend(work: Work, step, scratch: Scratch, wg: int, *, tuning, sm_scale, soft_cap):
    """Compute warpgroup `wg`: the online softmax of the item's q heads (in q_tile) over its steps, (acc, m, l).
    With two, a warpgroup takes the steps whose ring count (step on) has its parity."""
    bkv, wgs = tuning.block_kv, tuning.compute_warpgroups
    # steps inside [full_lo, full_hi) need no mask: every key visible
    full_lo = jnp.clip(pl.cdiv(work.first, bkv), work.lo, work.hi)
    full_hi = jnp.clip(work.kv_len // bkv, full_lo, work.hi)
    base = step - work.lo
    attend_one = functools.partial(attend_step, base=base, work=work, scratch=scratch, tuning=tuning,
                                   sm_scale=sm_scale, soft_cap=soft_cap)

    def steps(lo, hi, masked, carry):  # this warpgroup's steps of [lo, hi)
        first = lo + (wg + wgs - (base + lo) % wgs) % wgs
        count = pl.cdiv(jnp.maximum(hi - first, 0), wgs)
        return lax.fori_loop(0, count, lambda i, c: attend_one(first + i * wgs, c, masked=masked), carry)

    carry = wgmma_carry(scratch.q_tile.shape)
    carry = steps(work.lo, full_lo, True, carry)
    carry = steps(full_lo, full_hi, False, carry)
    return steps(full_hi, work.hi, True, carry)


def landed(ring: Ring, converted, slot):
    """The ring slot's tile once its pages landed, as wgmma reads it: itself, or converted into `converted`."""
    plgpu.barrier_wait(ring.ready.at[slot])
    return as_operand(ring.buffers.at[slot], converted)


def attend_step(s, carry, *, masked, base, work: Work, scratch: Scratch, tuning, sm_scale, soft_cap):
    """KV step s: ring slot (base + s) % depth, as the memory warpgroup counts."""
    acc, m, l = carry
    slot = (base + s) % tuning.max_concurrent_steps
    bkv = tuning.block_kv
    k_tile = landed(scratch.k, scratch.k_tile, slot)

    def qk(ref):
        plgpu.wgmma(ref, scratch.q_tile, k_tile.T)
        return ref[...]

    logits = log2_logits(pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, bkv), jnp.float32)), sm_scale, soft_cap)
    if masked:
        key = s * bkv + plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plgpu.Layout.WGMMA)
        logits = jnp.where((key >= work.first) & (key < work.kv_len), logits, -jnp.inf)
    m, p, alpha = online_softmax_step(m, logits)
    acc *= per_row(alpha, acc.shape)
    l = l * alpha + p.sum(axis=1)
    p = p.astype(scratch.q_tile.dtype)
    v_tile = landed(scratch.v, scratch.v_tile, slot)
    if scratch.v_tile is not None:  # converted: the ring slot can take the next pages
        plgpu.barrier_arrive(scratch.free.at[slot])
    if masked:  # V rows past the context (the null block's, or stale) may hold NaN
        pl.when((s + 1) * bkv > work.kv_len)(lambda: zero_rows_from(v_tile, work.kv_len - s * bkv))
    if scratch.p_tile is not None:  # the interpreter's wgmma takes SMEM operands only
        scratch.p_tile[...] = p
        plgpu.commit_smem()
        p = scratch.p_tile

    def pv(ref):
        plgpu.wgmma(ref, p, v_tile)
        return ref[...]

    acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    if scratch.v_tile is None:
        plgpu.barrier_arrive(scratch.free.at[slot])
    return acc, m, l


def store(work: Work, acc, m, l, outs, scratch: Scratch, group, staging):
    """The group's rows: normalised into the output (one split, through `staging`), or a float32 partial and its
    log2-sum-exp."""
    kv_head, slot = work.kv_head, work.slot
    out_ref = outs[0]
    if scratch.parts is None:
        staging[...] = normalize(acc, l).astype(staging.dtype)  # no keys: zeros
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging.at[pl.ds(0, group)], out_ref.at[slot, pl.ds(kv_head * group, group)])
    else:
        scratch.parts[...] = normalize(acc, l)
        scratch.lse[...] = m + jnp.log(l) * LOG2E  # -inf for an empty split: weight 0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(scratch.parts.at[pl.ds(0, group)], out_ref.at[slot, pl.ds(kv_head * group, group)])
        plgpu.copy_smem_to_gmem(scratch.lse, outs[1].at[slot, kv_head])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
