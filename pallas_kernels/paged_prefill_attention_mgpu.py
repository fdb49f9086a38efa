"""Paged causal prefill attention for Hopper (sm_90a): Pallas Mosaic GPU, FlashAttention-3 structure.

The prefill half of `ragged_paged_attention` on H100-class GPUs, where the Triton path stalls near half of
cuDNN (benchmarks/NOTES_attention.md). Same cache layout and metadata; decodes stay with the Triton kernel.

- Persistent grid (one CTA per SM) looping over work items (q tile x q head), so a batch with few or no
  prefill rows costs one short wave instead of thousands of empty CTAs. Work comes longest-causal first.
- Three warpgroups per CTA: two compute warpgroups own `block_q` query rows each (wgmma M = 64); one memory
  warpgroup streams K and V pages by TMA, `block_kv // block_size` page copies per pipeline step into one
  swizzled buffer, `max_concurrent_steps` deep. Its warps split the copies, two stream K and two V (all 16
  copies of a step from one thread, K queued behind V's free buffers, cost 4% at 8K). A schedule barrier
  alternates the two compute warpgroups on the tensor cores (one runs softmax while the other multiplies).
- Every warpgroup walks the same KV steps of a work item; steps outside a warpgroup's causal / window range
  only wait and release the buffers, which keeps barrier phases in lock step across work items.
- q tiles start at any row, which a swizzled TMA cannot address: q and the output pass through a plain SMEM
  buffer; outputs leave by a ladder of power-of-two-row TMA stores, so a tile never writes the next
  sequence's rows. Rows of decode sequences are left alone (the caller merges them in, in place).
"""
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.interpret import mosaic_interpret_params

LOG2E = math.log2(math.e)
COMPUTE_WGS = 2
H100_SMS = 132


@dataclass(frozen=True, slots=True)
class PrefillTuning:
    """Defaults measured on H100, bf16, head_dim 128 (benchmarks/NOTES_attention.md)."""
    block_q: int = 64  # rows per compute warpgroup: the wgmma M
    block_kv: int = 128  # keys per pipeline step
    max_concurrent_steps: int = 2
    wait_next_k_early: bool = True  # wait for step s+1's K while step s's PV wgmma runs (FA3)
    alternate_rounds: bool = True  # CTAs take work items in alternating order each round (`item_index`)
    num_ctas: int = H100_SMS  # persistent grid; the caller passes the device's core count when it has one


def supported(q, k_cache, soft_cap, tuning: PrefillTuning = PrefillTuning()) -> str | None:
    """None when this kernel can serve the shapes, else why not (the caller falls back to Triton)."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (needs bfloat16/float16)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if block_size % 8 or tuning.block_kv % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing block_kv={tuning.block_kv})"
    if soft_cap is not None:
        return "logit soft cap"
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
    tiles = jnp.where(is_decode, 0, (end - start + rows - 1) // rows)
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


def paged_prefill_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, num_seqs, *, sm_scale,
                            sliding_window=None, tuning: PrefillTuning = PrefillTuning(), interpret=False):
    """Attention rows of the non-decode sequences and zeros for the padding tail; decode rows undefined."""
    num_tokens, num_q_heads, head_dim = q.shape
    rows = COMPUTE_WGS * tuning.block_q
    meta = work_items(cu_q_lens, kv_lens, jnp.asarray(num_seqs).reshape(()), num_tokens, rows)
    kernel = functools.partial(
        prefill_kernel, tuning=tuning, sm_scale=float(sm_scale), sliding_window=sliding_window,
        group=num_q_heads // k_cache.shape[2], max_blocks=block_tables.shape[1])
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=scratch(q.dtype, head_dim, tuning, k_cache.shape[1], interpret),
        grid=(tuning.num_ctas,), grid_names=("cta",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params(interpret),
    )(meta, q, k_cache, v_cache, block_tables)


def scratch(dtype, head_dim, tuning: PrefillTuning, block_size, interpret):
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    steps, pages = tuning.max_concurrent_steps, tuning.block_kv // block_size
    return (
        plgpu.SMEM((COMPUTE_WGS, tuning.block_q, head_dim), dtype, transforms=swizzled),  # q
        plgpu.SMEM((steps, tuning.block_kv, head_dim), dtype, transforms=swizzled),  # k
        plgpu.SMEM((steps, tuning.block_kv, head_dim), dtype, transforms=swizzled),  # v
        plgpu.SMEM((COMPUTE_WGS, tuning.block_q, head_dim), dtype),  # q in, out: row-sliceable, any start row
        # softmax probabilities: registers feed wgmma on the GPU; the interpreter needs them in SMEM
        plgpu.SMEM((COMPUTE_WGS, tuning.block_q, tuning.block_kv), dtype, transforms=swizzled) if interpret else None,
        plgpu.Barrier(num_arrivals=pages, num_barriers=steps),  # k landed
        plgpu.Barrier(num_arrivals=pages, num_barriers=steps),  # v landed
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q landed
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),  # k consumed
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),  # v consumed
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # tensor-core turn
    )


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
    hi = cdiv(jnp.maximum(pos + rows, 0), block_kv)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.minimum(jnp.maximum(pos - sliding_window + 1, 0) // block_kv, hi)
    return Item(head, q_start, q_end, pos, seq, lo, hi, pos + rows)


def prefill_kernel(meta_ref, q_ref, k_ref, v_ref, bt_ref, out_ref, q_smem, k_smem, v_smem, o_smem, p_smem,
                   k_ready, v_ready, q_ready, k_free, v_free, turn, *, tuning, sm_scale, sliding_window, group,
                   max_blocks):
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
        compute = functools.partial(compute_item, refs=(q_ref, out_ref, q_smem.at[wg], k_smem, v_smem,
                                                        o_smem.at[wg], None if p_smem is None else p_smem.at[wg]),
                                    barriers=(k_ready, v_ready, q_ready.at[wg], k_free, v_free, turn), wg=wg,
                                    tuning=tuning, sm_scale=sm_scale, sliding_window=sliding_window)
        lax.fori_loop(0, num_items, lambda n, step: compute(locate_w(item_of(n, cta)), step), 0)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.warp_map(functools.partial(
            stream_warp, streams=((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)),
            bt_ref=bt_ref, items=lambda n: locate_w(item_of(n, cta)), num_items=num_items, tuning=tuning,
            group=group, max_blocks=max_blocks))


def item_index(n, cta, *, num_ctas, alternate):
    """The work item of a CTA's n-th round. With items longest first, a plain stride hands CTA 0 the longest
    item of every round (6% above the mean work at 8K causal: the tail everyone waits for); rounds that
    alternate direction even the totals out to within one item."""
    return n * num_ctas + (jnp.where(n % 2 == 0, cta, num_ctas - 1 - cta) if alternate else cta)


def stream_warp(warp, *, streams, bt_ref, items, num_items, tuning, group, max_blocks):
    """One warp of the memory warpgroup: warps 0-1 stream K, warps 2-3 stream V, each TMA-copying every other page
    of each KV step [lo, hi) of every work item into the ring. K runs ahead without waiting for V buffers to free
    up, and the copies of a step issue from two warps at once."""
    depth = tuning.max_concurrent_steps
    lane = warp % 2
    for role, (cache, smem, ready, free) in enumerate(streams):  # (cache, SMEM ring, landed, consumed): K, V
        stream = functools.partial(stream_item, lane=lane, cache=cache, bt_ref=bt_ref, smem=smem, ready=ready,
                                   free=free, tuning=tuning, group=group, max_blocks=max_blocks)

        @pl.when(warp // 2 == role)
        def _(stream=stream, free=free):
            steps = lax.fori_loop(0, num_items, lambda n, step: stream(items(n), step), 0)
            for i in range(depth):  # observe the last releases before the barriers go
                last = steps - depth + i
                pl.when(last >= 0)(lambda: plgpu.barrier_wait(free.at[last % depth]))


def stream_item(item: Item, step, *, lane, cache, bt_ref, smem, ready, free, tuning, group, max_blocks):
    """Pages lane, lane + 2, ... of the item's KV steps, K or V; returns the running step count."""
    block_size = cache.shape[1]
    pages, kv_head = tuning.block_kv // block_size, item.head // group

    def one(s, step):
        slot = step % tuning.max_concurrent_steps
        copies = []
        for j in range(cdiv(pages, 2)):
            i = jnp.minimum(2 * j + lane, pages - 1)
            c = s * pages + i
            # Pages past the last visible key may not exist in the table: read the null block instead (the compute
            # side zeroes those V rows). The ids load before the wait below, so their latency hides behind it.
            page = jnp.where(c * block_size < item.key_bound, bt_ref[item.seq, jnp.minimum(c, max_blocks - 1)], 0)
            copies.append((i, page, 2 * j + lane < pages))  # an odd page count leaves lane 1 one copy short
        pl.when(step >= tuning.max_concurrent_steps)(lambda: plgpu.barrier_wait(free.at[slot]))
        for i, page, live in copies:
            @pl.when(live)
            def _():
                plgpu.copy_gmem_to_smem(cache.at[page, :, kv_head], smem.at[slot, pl.ds(i * block_size, block_size)],
                                        ready.at[slot])
        return step + 1

    return lax.fori_loop(item.lo, item.hi, one, step)


def compute_item(item: Item, step, *, refs, barriers, wg, tuning, sm_scale, sliding_window):
    """Compute warpgroup: block_q rows of one q head over the item's KV steps; returns the running step count."""
    q_ref, out_ref, q_smem, k_smem, v_smem, o_smem, p_smem = refs
    k_ready, v_ready, q_ready, k_free, v_free, turn = barriers
    bq, bkv = tuning.block_q, tuning.block_kv
    row0 = item.q_start + wg * bq
    rows = jnp.clip(item.q_end - row0, 0, bq)
    pos_first, pos_last = item.pos + wg * bq, item.pos + wg * bq + rows - 1
    # A tiled TMA needs a tile-aligned start row and q tiles start anywhere: land q in the plain output
    # buffer (free again since the last item's stores were waited for), then swizzle it over.
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, bq), item.head], o_smem, q_ready)
    plgpu.barrier_wait(q_ready)
    q_smem[...] = o_smem[...]
    plgpu.commit_smem()

    # This warpgroup's steps: [lo, hi) attend; inside it, [full_lo, full_hi) need no mask.
    hi = jnp.where(rows > 0, cdiv(pos_last + 1, bkv), item.lo)
    hi = jnp.clip(hi, item.lo, item.hi)
    full_hi = jnp.clip((pos_first + 1) // bkv, item.lo, hi)
    lo, full_lo = item.lo, item.lo
    if sliding_window is not None:
        lo = jnp.clip(jnp.maximum(pos_first - sliding_window + 1, 0) // bkv, item.lo, hi)
        full_lo = jnp.clip(cdiv(jnp.maximum(pos_last - sliding_window + 1, 0), bkv), lo, full_hi)
    row_pos = pos_first + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
    base = step - item.lo  # ring slot of step s: (base + s) % max_concurrent_steps, as the memory warpgroup counts
    attend = functools.partial(attend_step, base=base, hi=hi, q_smem=q_smem, p_smem=p_smem, kv=(k_smem, v_smem),
                               barriers=barriers, row_pos=row_pos, key_bound=item.key_bound, tuning=tuning,
                               sm_scale=sm_scale, sliding_window=sliding_window)
    skip = functools.partial(skip_step, base=base, barriers=barriers, tuning=tuning)

    m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((bq, q_ref.shape[2]), 0, jnp.float32), plgpu.Layout.WGMMA)
    pl.when(wg == 1)(functools.partial(take_turn, turn))
    lax.fori_loop(item.lo, lo, skip, None)
    if tuning.wait_next_k_early:  # attend steps find their K waited for by the step before; the first, here
        pl.when(lo < hi)(lambda: plgpu.barrier_wait(k_ready.at[(base + lo) % tuning.max_concurrent_steps]))
    carry = lax.fori_loop(lo, full_lo, functools.partial(attend, masked=True), (acc, m, l))
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(attend, masked=False), carry)
    acc, m, l = lax.fori_loop(full_hi, hi, functools.partial(attend, masked=True), carry)
    lax.fori_loop(hi, item.hi, skip, None)
    pl.when(wg == 0)(functools.partial(take_turn, turn))

    l = jnp.where(l == 0, 1.0, l)  # rows with no keys (padding) come out as zeros
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    store_rows(o_smem, out_ref, item.head, row0, rows)
    return step + item.hi - item.lo


def attend_step(s, carry, *, masked, base, hi, q_smem, p_smem, kv, barriers, row_pos, key_bound, tuning, sm_scale,
                sliding_window):
    """One KV step of the online softmax (FlashAttention-3 order: QK, softmax while the other warpgroup
    multiplies, PV)."""
    k_smem, v_smem = kv
    k_ready, v_ready, _, k_free, v_free, turn = barriers
    acc, m, l = carry
    slot = (base + s) % tuning.max_concurrent_steps
    bq, bkv = row_pos.shape
    if not tuning.wait_next_k_early:
        plgpu.barrier_wait(k_ready.at[slot])

    def qk_scope(qk_ref):
        plgpu.wgmma(qk_ref, q_smem, k_smem.at[slot].T)
        take_turn(turn)
        return qk_ref[...]

    logits = pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32)) * (sm_scale * LOG2E)
    plgpu.barrier_arrive(k_free.at[slot])
    if masked:
        key = s * bkv + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
        ok = key <= row_pos
        if sliding_window is not None:
            ok &= key > row_pos - sliding_window
        logits = jnp.where(ok, logits, -jnp.inf)
    m_new = jnp.maximum(m, logits.max(axis=1))
    # With a window a row can see nothing in a step: keep its max finite so exp2 gives 0, not NaN.
    m_use = m_new if sliding_window is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(logits - lax.broadcast_in_dim(m_use, logits.shape, [0]))
    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = l * alpha + p.sum(axis=1)
    p = p.astype(v_smem.dtype)
    acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))  # softmax done before the turn (FA3)
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(v_ready.at[slot])
    if masked:  # V rows past the visible keys may hold stale or NaN data, and 0 * NaN would leak into acc
        pl.when((s + 1) * bkv > key_bound)(lambda: zero_rows_from(v_smem.at[slot], key_bound - s * bkv))
    plgpu.barrier_wait(turn)

    if p_smem is not None:  # the interpreter's wgmma takes SMEM operands only
        p_smem[...] = p
        plgpu.commit_smem()
        p = p_smem

    def pv(pv_ref):
        plgpu.wgmma(pv_ref, p, v_smem.at[slot])
        if tuning.wait_next_k_early:
            nxt = (base + s + 1) % tuning.max_concurrent_steps
            pl.when(s + 1 < hi)(lambda: plgpu.barrier_wait(k_ready.at[nxt]))
        return pv_ref[...]

    # PV into a fresh accumulator, added to acc: measured faster on the H100 than FA3's in-place accumulation
    # (450 vs 433 TFLOP/s at 8K), and the only form the interpreter runs.
    acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    plgpu.barrier_arrive(v_free.at[slot])
    return acc, m_new, l


def zero_rows_from(v_tile, first, rows_per_pass=64):
    """v_tile[first:] = 0 in place. Both compute warpgroups may do this to one buffer: they write the same zeros."""
    for start in range(0, v_tile.shape[0], rows_per_pass):
        part = v_tile.at[pl.ds(start, rows_per_pass)]
        row = start + plgpu.broadcasted_iota(jnp.int32, part.shape, 0, layout=plgpu.Layout.WGMMA)
        part[...] = jnp.where(row < first, part[...], jnp.zeros((), part.dtype))
    plgpu.commit_smem()


def skip_step(s, carry, *, base, barriers, tuning):
    """A step outside this warpgroup's rows' range: wait for the buffers and free them (phases stay in step)."""
    k_ready, v_ready, _, k_free, v_free, turn = barriers
    slot = (base + s) % tuning.max_concurrent_steps
    plgpu.barrier_wait(k_ready.at[slot])
    plgpu.barrier_arrive(k_free.at[slot])
    take_turn(turn)
    plgpu.barrier_wait(v_ready.at[slot])
    plgpu.barrier_arrive(v_free.at[slot])
    take_turn(turn)
    return carry


def take_turn(turn):
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def store_rows(o_smem, out_ref, head, row0, rows):
    """out_ref[row0 : row0 + rows, head] = o_smem[:rows] by TMA stores of 2^k rows (shapes must be static)."""
    done, n = 0, o_smem.shape[0]
    while n:
        @pl.when(rows & n != 0)
        def _(done=done, n=n):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(done, n)], out_ref.at[pl.ds(row0 + done, n), head])
        done += rows & n
        n //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def cdiv(a, b):
    return (a + b - 1) // b
