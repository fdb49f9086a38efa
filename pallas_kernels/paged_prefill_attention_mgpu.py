"""Paged causal prefill attention for Hopper (sm_90a): Pallas Mosaic GPU, FlashAttention-3 structure.

The prefill half of `ragged_paged_attention` on H100-class GPUs, where it runs well ahead of the Triton path:
prefill is compute bound, and page copies by TMA from a warpgroup of their own keep the tensor cores fed. Same
cache layout and metadata; decodes stay with the Triton kernel. K and V go from TMA straight into wgmma, except
from an fp8 (e4m3) cache: each compute warpgroup converts a step's K, then its V, into one float16 tile of its own
(e4m3 -> bf16 takes a newer PTX than CUDA 13's) and q is clipped to float16's range, as the decode kernel does.

- Persistent grid (one CTA per SM) looping over work items (q tile x q head), so a batch with few or no
  prefill rows costs one short wave instead of thousands of empty CTAs. Work comes longest-causal first.
- Three warpgroups per CTA: two compute warpgroups own `block_q` query rows each (wgmma M = 64); one memory
  warpgroup streams K and V pages by TMA, `block_kv // block_size` page copies per pipeline step into one
  swizzled buffer, `max_concurrent_steps` deep. Its warps split the copies, two stream K and two V, so no one
  thread issues every copy of a step and K never queues behind V's buffers. A schedule barrier alternates the
  two compute warpgroups on the tensor cores (one runs softmax while the other multiplies).
- Every warpgroup walks the same KV steps of a work item; steps outside a warpgroup's causal / window range
  only wait and release the buffers, which keeps barrier phases in lock step across work items.
- q tiles start at any row, which a swizzled TMA cannot address: q and the output pass through a plain SMEM
  buffer; outputs leave by a ladder of power-of-two-row TMA stores, so a tile never writes the next
  sequence's rows. Rows of decode sequences are left alone (the caller merges them in, in place).
- Contiguous (vAttention) caches: given each sequence's first page (and `blocks_per_row`) in place of the block
  table, page c of sequence s is first[s] + c * block_stride, computed (`TablePages` / `SlotPages`); the stride is
  a cross-layer cache's layer count.
"""
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (FP8_CACHE, as_dot_dtype, init_carry, log2_logits, mosaic_interpret_params,
                                   normalize, online_softmax_step, per_row)

COMPUTE_WGS = 2
H100_SMS = 132


@dataclass(frozen=True, slots=True)
class PrefillTuning:
    """Defaults tuned on H100, bf16, head_dim 128."""
    block_q: int = 64  # rows per compute warpgroup: the wgmma M
    block_kv: int = 128  # keys per pipeline step
    max_concurrent_steps: int = 2
    wait_next_k_early: bool = True  # wait for step s+1's K while step s's PV wgmma runs (FA3)
    alternate_rounds: bool = True  # CTAs take work items in alternating order each round (`item_index`)
    num_ctas: int = H100_SMS  # persistent grid; the caller passes the device's core count when it has one


def supported(q, k_cache, tuning: PrefillTuning = PrefillTuning()) -> str | None:
    """None when this kernel can serve the shapes, else why not (the caller falls back to Triton)."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (needs bfloat16/float16)"
    if k_cache.dtype not in (q.dtype, FP8_CACHE):
        return f"KV cache dtype {k_cache.dtype} (needs q's, {q.dtype}, or float8_e4m3fn)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if block_size % 8 or tuning.block_kv % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing block_kv={tuning.block_kv})"
    return None


def work_items(cu_q_lens, kv_lens, num_seqs, num_tokens, rows):
    """Per q tile (rows = 2 * block_q query rows of one sequence): [q_start, q_end, pos of q_start, seq].

    Segment i < num_seqs is sequence i; segment num_seqs is the padding tail, attended over no keys so its
    rows come out as zeros. The leading run of decodes (q_len == 1) gets no tiles. Tiles are listed longest
    causal range first; the count comes back as the last row's first entry.
    """
    max_seqs = kv_lens.shape[0]
    i = jnp.arange(max_seqs + 1)
    start = jnp.where(i <= num_seqs, cu_q_lens, num_tokens)
    end = jnp.where(i < num_seqs, cu_q_lens[jnp.minimum(i + 1, max_seqs)], num_tokens)
    end = jnp.maximum(end, start)
    is_decode = (i < num_seqs) & (end == i + 1)
    tiles = jnp.where(is_decode, 0, pl.cdiv(end - start, rows))
    first = jnp.cumsum(tiles) - tiles
    total = jnp.sum(tiles)
    max_tiles = num_tokens // rows + max_seqs + 1
    t = total - 1 - jnp.arange(max_tiles)  # reversed: within a sequence, the last (longest) tile first
    # Segment of tile t: how many segments end at or before it. One fused compare (searchsorted's default
    # lowers to a while loop, whose every iteration costs a device-to-host sync on GPU).
    seg = jnp.minimum(jnp.sum(first[None, :] + tiles[None, :] <= t[:, None], axis=1), max_seqs)
    q_start = start[seg] + (t - first[seg]) * rows
    kv_len = jnp.where(seg < num_seqs, kv_lens[jnp.minimum(seg, max_seqs - 1)], 0)
    pos = kv_len - (end[seg] - start[seg]) + (q_start - start[seg])
    live = t >= 0
    meta = jnp.stack([jnp.where(live, q_start, 0), jnp.where(live, end[seg], 0), jnp.where(live, pos, 0),
                      jnp.minimum(seg, max_seqs - 1)], axis=1).astype(jnp.int32)
    return jnp.concatenate([meta, jnp.stack([total, 0, 0, 0])[None].astype(jnp.int32)])


def paged_prefill_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, blocks, num_seqs, *, sm_scale,
                            sliding_window=None, soft_cap=None, tuning: PrefillTuning = PrefillTuning(),
                            interpret=False, blocks_per_row: int | None = None, block_stride: int = 1):
    """Attention rows of the non-decode sequences and zeros for the padding tail; decode rows undefined.
    blocks: the block table [max_seqs, max_blocks], or (blocks_per_row given) each sequence's first block, its
    row's blocks block_stride apart."""
    num_tokens, num_q_heads, head_dim = q.shape
    rows = COMPUTE_WGS * tuning.block_q
    meta = work_items(cu_q_lens, kv_lens, jnp.asarray(num_seqs).reshape(()), num_tokens, rows)
    kernel = functools.partial(
        mosaic_prefill_kernel, tuning=tuning, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=num_q_heads // k_cache.shape[2],
        blocks_per_row=blocks_per_row, block_stride=block_stride)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=(scratch(q.dtype, k_cache.dtype, head_dim, tuning, k_cache.shape[1], interpret),),
        grid=(tuning.num_ctas,), grid_names=("cta",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params(interpret),
    )(meta, q, k_cache, v_cache, blocks)


@dataclass(frozen=True)
class TablePages:
    """Paged: page c of sequence s is the block table's entry [s, c], one load per page copy."""
    ref: Any  # block_tables [max_seqs, max_blocks]

    def of(self, seq):
        return seq  # the table row

    def page(self, seq, col):
        return self.ref[seq, jnp.minimum(col, self.ref.shape[1] - 1)]


@dataclass(frozen=True)
class SlotPages:
    """Contiguous: sequence s's page c is first[s] + c * stride (first[s]: its row's first page)."""
    ref: Any  # first pages [max_seqs]
    blocks_per_row: int
    stride: int = 1

    def of(self, seq):
        return self.ref[seq]  # one load per work item

    def page(self, first, col):
        return first + jnp.minimum(col, self.blocks_per_row - 1) * self.stride


def page_addressing(blocks_ref, blocks_per_row, block_stride=1) -> TablePages | SlotPages:
    return TablePages(blocks_ref) if blocks_per_row is None else SlotPages(blocks_ref, blocks_per_row, block_stride)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Ring:
    """The SMEM ring K or V pages land in: one buffer per pipeline step in flight, with its two barriers."""
    buffers: Any  # [max_concurrent_steps, block_kv, head_dim], swizzled for wgmma
    ready: Any  # per buffer: the step's pages landed (one arrival per page copy)
    free: Any  # per buffer: both compute warpgroups are done with it


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Scratch:
    """A CTA's SMEM and barriers (a pytree of refs: the kernel's scratch argument). Per-warpgroup buffers have a
    leading COMPUTE_WGS axis."""
    q_tiles: Any  # q swizzled: the wgmma operand
    k: Ring
    v: Ring
    staging: Any  # q in, output out: plain, so rows can start anywhere
    p_tiles: Any  # softmax probabilities for the interpreter's wgmma (SMEM operands only); None on the GPU
    kv_tiles: Any  # per warpgroup, an fp8 cache's step converted for wgmma (K, then V); None for q's dtype
    q_ready: Any  # per warpgroup: its q landed
    turn: Any  # the compute warpgroups take turns on the tensor cores


def scratch(dtype, cache_dtype, head_dim, tuning: PrefillTuning, block_size, interpret) -> Scratch:
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    steps, pages = tuning.max_concurrent_steps, tuning.block_kv // block_size
    fp8 = jnp.dtype(cache_dtype) == FP8_CACHE
    compute = jnp.float16 if fp8 else dtype

    def ring():  # an fp8 ring is only read into registers: plain
        return Ring(plgpu.SMEM((steps, tuning.block_kv, head_dim), cache_dtype, transforms=() if fp8 else swizzled),
                    ready=plgpu.Barrier(num_arrivals=pages, num_barriers=steps),
                    free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps))

    def per_warpgroup(rows, cols, element):
        return plgpu.SMEM((COMPUTE_WGS, rows, cols), element, transforms=swizzled)

    return Scratch(
        q_tiles=per_warpgroup(tuning.block_q, head_dim, compute),
        k=ring(), v=ring(),
        staging=plgpu.SMEM((COMPUTE_WGS, tuning.block_q, head_dim), dtype),
        p_tiles=per_warpgroup(tuning.block_q, tuning.block_kv, compute) if interpret else None,
        kv_tiles=per_warpgroup(tuning.block_kv, head_dim, compute) if fp8 else None,
        q_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        turn=plgpu.Barrier(num_arrivals=COMPUTE_WGS))


@dataclass(frozen=True)
class KVStream:
    """K or V on its way in: the paged cache in HBM and the ring its pages are copied into."""
    cache: Any  # [num_blocks, block_size, num_kv_heads, head_dim]
    ring: Ring


@dataclass(frozen=True)
class Warpgroup:
    """What one compute warpgroup works with: q and the output in HBM, its own slices of the SMEM buffers, and
    the K/V rings and tensor-core turn it shares with the other."""
    q: Any  # [num_tokens, num_q_heads, head_dim]
    out: Any
    q_tile: Any  # this warpgroup's slices of Scratch's q_tiles, staging, p_tiles, kv_tiles and q_ready
    staging: Any
    p_tile: Any
    kv_tile: Any
    q_ready: Any
    k: Ring
    v: Ring
    turn: Any

    @classmethod
    def of(cls, wg, q_ref, out_ref, scratch: Scratch) -> "Warpgroup":
        def own(ref):
            return None if ref is None else ref.at[wg]
        return cls(q_ref, out_ref, scratch.q_tiles.at[wg], scratch.staging.at[wg], own(scratch.p_tiles),
                   own(scratch.kv_tiles), scratch.q_ready.at[wg], scratch.k, scratch.v, scratch.turn)


@dataclass(frozen=True)
class Item:
    """One work item: a tile of up to 2 * block_q query rows [q_start, ...) of one sequence, for q head `head`,
    and the KV steps its two warpgroups need."""
    head: jax.Array
    q_start: jax.Array
    q_end: jax.Array
    pos: jax.Array  # position of row q_start
    seq: jax.Array
    lo: jax.Array  # KV steps [lo, hi) loaded for this item
    hi: jax.Array
    key_bound: jax.Array  # keys at or past this are visible to none of the item's rows


def locate(meta_ref, w, num_q_heads, block_q, block_kv, sliding_window) -> Item:
    tile, head = w // num_q_heads, w % num_q_heads
    q_start, q_end, pos, seq = (meta_ref[tile, j] for j in range(4))
    rows = jnp.clip(q_end - q_start, 0, COMPUTE_WGS * block_q)
    hi = pl.cdiv(jnp.maximum(pos + rows, 0), block_kv)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.minimum(jnp.maximum(pos - sliding_window + 1, 0) // block_kv, hi)
    return Item(head, q_start, q_end, pos, seq, lo, hi, pos + rows)


def mosaic_prefill_kernel(meta_ref, q_ref, k_ref, v_ref, blocks_ref, out_ref, scratch: Scratch, *, tuning, sm_scale,
                          sliding_window, soft_cap, group, blocks_per_row, block_stride):
    """One CTA: its compute warpgroups and its memory warpgroup walk the same work items, in the same order."""
    num_q_heads = q_ref.shape[1]
    total = meta_ref[meta_ref.shape[0] - 1, 0] * num_q_heads
    cta, num_ctas = lax.axis_index("cta"), tuning.num_ctas
    locate_w = functools.partial(locate, meta_ref, num_q_heads=num_q_heads, block_q=tuning.block_q,
                                 block_kv=tuning.block_kv, sliding_window=sliding_window)
    rounds = total // num_ctas
    item_of = functools.partial(item_index, num_ctas=num_ctas, alternate=tuning.alternate_rounds)
    num_items = rounds + (item_of(rounds, cta) < total).astype(jnp.int32)
    wg = lax.axis_index("wg")

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        compute = functools.partial(compute_item, refs=Warpgroup.of(wg, q_ref, out_ref, scratch), wg=wg,
                                    tuning=tuning, sm_scale=sm_scale, sliding_window=sliding_window,
                                    soft_cap=soft_cap)
        lax.fori_loop(0, num_items, lambda n, step: compute(locate_w(item_of(n, cta)), step), 0)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.warp_map(functools.partial(
            stream_warp, k=KVStream(k_ref, scratch.k), v=KVStream(v_ref, scratch.v),
            pages=page_addressing(blocks_ref, blocks_per_row, block_stride), items=lambda n: locate_w(item_of(n, cta)),
            num_items=num_items, tuning=tuning, group=group))


def item_index(n, cta, *, num_ctas, alternate):
    """The work item of a CTA's n-th round. With items longest first, a plain stride hands CTA 0 the longest
    item of every round (the tail everyone waits for); rounds that alternate direction even the totals out to
    within one item."""
    return n * num_ctas + (jnp.where(n % 2 == 0, cta, num_ctas - 1 - cta) if alternate else cta)


def stream_warp(warp, *, k: KVStream, v: KVStream, pages: TablePages | SlotPages, items, num_items, tuning, group):
    """One warp of the memory warpgroup: warps 0-1 stream K, warps 2-3 stream V, each TMA-copying every other page
    of each KV step [lo, hi) of every work item into the ring. K runs ahead without waiting for V buffers to free
    up, and the copies of a step issue from two warps at once."""
    depth = tuning.max_concurrent_steps
    lane = warp % 2
    for role, kv in enumerate((k, v)):
        stream = functools.partial(stream_item, lane=lane, kv=kv, pages=pages, tuning=tuning, group=group)

        @pl.when(warp // 2 == role)
        def _(stream=stream, free=kv.ring.free):
            steps = lax.fori_loop(0, num_items, lambda n, step: stream(items(n), step), 0)
            for i in range(depth):  # observe the last releases before the barriers go
                last = steps - depth + i
                pl.when(last >= 0)(lambda: plgpu.barrier_wait(free.at[last % depth]))


def stream_item(item: Item, step, *, lane, kv: KVStream, pages: TablePages | SlotPages, tuning, group):
    """Pages lane, lane + 2, ... of the item's KV steps, K or V; returns the running step count."""
    block_size = kv.cache.shape[1]
    per_step, kv_head = tuning.block_kv // block_size, item.head // group
    seq_pages = pages.of(item.seq)

    def one(s, step):
        slot = step % tuning.max_concurrent_steps
        copies = []
        for j in range(pl.cdiv(per_step, 2)):
            i = jnp.minimum(2 * j + lane, per_step - 1)
            c = s * per_step + i
            # Pages past the last visible key may not exist in the table: read the null block instead (the compute
            # side zeroes those V rows). The ids load before the wait below, so their latency hides behind it.
            page = jnp.where(c * block_size < item.key_bound, pages.page(seq_pages, c), 0)
            copies.append((i, page, 2 * j + lane < per_step))  # an odd page count leaves lane 1 one copy short
        pl.when(step >= tuning.max_concurrent_steps)(lambda: plgpu.barrier_wait(kv.ring.free.at[slot]))
        for i, page, live in copies:
            @pl.when(live)
            def _():
                plgpu.copy_gmem_to_smem(kv.cache.at[page, :, kv_head],
                                        kv.ring.buffers.at[slot, pl.ds(i * block_size, block_size)],
                                        kv.ring.ready.at[slot])
        return step + 1

    return lax.fori_loop(item.lo, item.hi, one, step)


def compute_item(item: Item, step, *, refs: Warpgroup, wg, tuning, sm_scale, sliding_window, soft_cap):
    """Compute warpgroup: block_q rows of one q head over the item's KV steps; returns the running step count."""
    bq, bkv = tuning.block_q, tuning.block_kv
    row0 = item.q_start + wg * bq
    rows = jnp.clip(item.q_end - row0, 0, bq)
    pos_first, pos_last = item.pos + wg * bq, item.pos + wg * bq + rows - 1
    # A tiled TMA needs a tile-aligned start row and q tiles start anywhere: land q in the plain staging
    # buffer (free again since the last item's stores were waited for), then swizzle it over.
    plgpu.copy_gmem_to_smem(refs.q.at[pl.ds(row0, bq), item.head], refs.staging, refs.q_ready)
    plgpu.barrier_wait(refs.q_ready)
    refs.q_tile[...] = as_dot_dtype(refs.staging[...], refs.q_tile.dtype)
    plgpu.commit_smem()

    # This warpgroup's steps: [lo, hi) attend; inside it, [full_lo, full_hi) need no mask.
    hi = jnp.where(rows > 0, pl.cdiv(pos_last + 1, bkv), item.lo)
    hi = jnp.clip(hi, item.lo, item.hi)
    full_hi = jnp.clip((pos_first + 1) // bkv, item.lo, hi)
    lo, full_lo = item.lo, item.lo
    if sliding_window is not None:
        lo = jnp.clip(jnp.maximum(pos_first - sliding_window + 1, 0) // bkv, item.lo, hi)
        full_lo = jnp.clip(pl.cdiv(jnp.maximum(pos_last - sliding_window + 1, 0), bkv), lo, full_hi)
    row_pos = pos_first + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
    base = step - item.lo  # ring slot of step s: (base + s) % max_concurrent_steps, as the memory warpgroup counts
    attend = functools.partial(attend_step, base=base, hi=hi, refs=refs, row_pos=row_pos, key_bound=item.key_bound,
                               tuning=tuning, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    skip = functools.partial(skip_step, base=base, refs=refs, tuning=tuning)

    carry = wgmma_carry((bq, refs.q.shape[2]))
    pl.when(wg == 1)(functools.partial(take_turn, refs.turn))
    lax.fori_loop(item.lo, lo, skip, None)
    if tuning.wait_next_k_early:  # attend steps find their K waited for by the step before; the first, here
        pl.when(lo < hi)(lambda: plgpu.barrier_wait(refs.k.ready.at[(base + lo) % tuning.max_concurrent_steps]))
    carry = lax.fori_loop(lo, full_lo, functools.partial(attend, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(attend, masked=False), carry)
    acc, _, l = lax.fori_loop(full_hi, hi, functools.partial(attend, masked=True), carry)
    lax.fori_loop(hi, item.hi, skip, None)
    pl.when(wg == 0)(functools.partial(take_turn, refs.turn))

    refs.staging[...] = normalize(acc, l).astype(refs.staging.dtype)  # rows with no keys (padding): zeros
    plgpu.commit_smem()
    store_out_rows(refs.staging, refs.out, item.head, row0, rows)
    return step + item.hi - item.lo


def wgmma_carry(shape):
    """`init_carry` in the register layouts of the wgmma accumulator and of its row vectors."""
    acc, m, l = init_carry(shape)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.layout_cast(acc, plgpu.Layout.WGMMA), plgpu.layout_cast(m, row_layout),
            plgpu.layout_cast(l, row_layout))


def attend_step(s, carry, *, masked, base, hi, refs: Warpgroup, row_pos, key_bound, tuning, sm_scale,
                sliding_window, soft_cap):
    """One KV step of the online softmax (FlashAttention-3 order: QK, softmax while the other warpgroup
    multiplies, PV)."""
    acc, m, l = carry
    slot = (base + s) % tuning.max_concurrent_steps
    bq, bkv = row_pos.shape
    if not tuning.wait_next_k_early:
        plgpu.barrier_wait(refs.k.ready.at[slot])
    k_tile = as_operand(refs.k.buffers.at[slot], refs.kv_tile)

    def qk_scope(qk_ref):
        plgpu.wgmma(qk_ref, refs.q_tile, k_tile.T)
        take_turn(refs.turn)
        return qk_ref[...]

    logits = log2_logits(pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32)), sm_scale, soft_cap)
    plgpu.barrier_arrive(refs.k.free.at[slot])
    if masked:
        key = s * bkv + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
        ok = key <= row_pos
        if sliding_window is not None:
            ok &= key > row_pos - sliding_window
        logits = jnp.where(ok, logits, -jnp.inf)
    # Without a window every row sees key 0 in its first step, so its max is never -inf.
    m, p, alpha = online_softmax_step(m, logits, rows_see_keys=sliding_window is None)
    acc *= per_row(alpha, acc.shape)
    l = l * alpha + p.sum(axis=1)
    p = p.astype(refs.q_tile.dtype)
    acc, l, m, p = lax.optimization_barrier((acc, l, m, p))  # softmax done before the turn (FA3)
    plgpu.barrier_arrive(refs.turn)
    plgpu.barrier_wait(refs.v.ready.at[slot])
    v_tile = as_operand(refs.v.buffers.at[slot], refs.kv_tile)  # converted over K's, whose QK is done
    if masked:  # V rows past the visible keys may hold stale or NaN data, and 0 * NaN would leak into acc
        pl.when((s + 1) * bkv > key_bound)(lambda: zero_rows_from(v_tile, key_bound - s * bkv))
    plgpu.barrier_wait(refs.turn)

    if refs.p_tile is not None:  # the interpreter's wgmma takes SMEM operands only
        refs.p_tile[...] = p
        plgpu.commit_smem()
        p = refs.p_tile

    def pv(pv_ref):
        plgpu.wgmma(pv_ref, p, v_tile)
        if tuning.wait_next_k_early:
            nxt = (base + s + 1) % tuning.max_concurrent_steps
            pl.when(s + 1 < hi)(lambda: plgpu.barrier_wait(refs.k.ready.at[nxt]))
        return pv_ref[...]

    # PV into a fresh accumulator, added to acc: faster here than FA3's in-place accumulation,
    # and the only form the interpreter runs.
    acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    plgpu.barrier_arrive(refs.v.free.at[slot])
    return acc, m, l


def as_operand(slot, tile):
    """A landed ring slot as wgmma reads it: itself, or (an fp8 cache) converted into the warpgroup's tile."""
    if tile is None:
        return slot
    tile[...] = slot[...].astype(tile.dtype)
    plgpu.commit_smem()
    return tile


def zero_rows_from(v_tile, first, rows_per_pass=64):
    """v_tile[first:] = 0 in place. Both compute warpgroups may do this to one buffer: they write the same zeros."""
    for start in range(0, v_tile.shape[0], rows_per_pass):
        part = v_tile.at[pl.ds(start, rows_per_pass)]
        row = start + plgpu.broadcasted_iota(jnp.int32, part.shape, 0, layout=plgpu.Layout.WGMMA)
        part[...] = jnp.where(row < first, part[...], jnp.zeros((), part.dtype))
    plgpu.commit_smem()


def skip_step(s, carry, *, base, refs: Warpgroup, tuning):
    """A step outside this warpgroup's rows' range: wait for the buffers and free them (phases stay in step)."""
    slot = (base + s) % tuning.max_concurrent_steps
    for ring in (refs.k, refs.v):
        plgpu.barrier_wait(ring.ready.at[slot])
        plgpu.barrier_arrive(ring.free.at[slot])
        take_turn(refs.turn)
    return carry


def take_turn(turn):
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def store_out_rows(staging, out_ref, head, row0, rows):
    """out_ref[row0 : row0 + rows, head] = staging[:rows] by TMA stores of 2^k rows (shapes must be static), so a
    tile never writes past its sequence's rows."""
    done, n = 0, staging.shape[0]
    while n:
        @pl.when(rows & n != 0)
        def _(done=done, n=n):
            plgpu.copy_smem_to_gmem(staging.at[pl.ds(done, n)], out_ref.at[pl.ds(row0 + done, n), head])
        done += rows & n
        n //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
