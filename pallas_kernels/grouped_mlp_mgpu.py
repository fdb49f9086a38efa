"""A decode step's whole expert MLP in one launch for Hopper (sm_90a): Pallas Mosaic GPU, TMA tiles into wgmma.

down_g(silu(gate_g x) * up_g x) for rows sorted by expert group, planned as `grouped_matmul_mgpu` plans them (the
routing call's tiles), with down's K (the intermediate width I) split over the work units:

- A work unit is (tile, i-block): it runs grouped_swiglu's narrow unit (gate's and up's block_i channels over all
  of K, the tile's rows read once), keeps silu(gate) * up in shared memory, and multiplies it by down's block_i
  columns for every block_n of H. Its f32 partial of down for the tile's own rows (its group's, not the rows of
  neighbouring groups that TMA's 8-row alignment brings along) goes to partials[sorted row, i-block]; `combine`
  sums a pair's i-blocks and its token's experts in XLA. Each partial is written by one unit: no atomics, the
  same bits every run.
- Why one launch: at batch 1 (8 experts of Qwen3-30B-A3B, 96 units of 12) the two launches of
  grouped_swiglu / grouped_matmul_padded each pay a launch and a pipeline ramp, and down's units stream 12 steps
  each; here a unit streams gate, up and its slice of down (768 KiB) back to back and the hidden rows never reach
  HBM. The partials cost I / block_i f32 rows per pair (12 x 8 KiB at Qwen3's shapes), so the launch is for steps
  of few pairs: `fused_mlp_takes`.
"""
import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import mosaic_interpret_params
from pallas_kernels.grouped_matmul_mgpu import ROW_ALIGN, RING_BYTES, GroupedTuning, RowPlan, accumulate


def fused_mlp_takes(lhs, gate, down, num_pairs: int, tuning: GroupedTuning) -> bool:
    """Whether a step of num_pairs token-expert pairs runs the experts' MLP in one launch: few enough pairs (the
    partials grow with them), shapes grouped_mlp serves."""
    return num_pairs <= tuning.fused_max_pairs and fused_supported(lhs, gate, down, tuning) is None


def fused_supported(lhs, gate, down, tuning: GroupedTuning = GroupedTuning()) -> str | None:
    """None when grouped_mlp can serve the shapes, else why not."""
    (i, h), dtypes = gate.shape[1:], {lhs.dtype, gate.dtype, down.dtype}
    if len(dtypes) > 1 or lhs.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtypes {lhs.dtype}, {gate.dtype}, {down.dtype} (need one of bfloat16 and float16 for all)"
    if h % tuning.block_k or h % tuning.block_n or i % tuning.block_i or down.shape[1:] != (h, i):
        return (f"H={h}, I={i}, down [G, {', '.join(map(str, down.shape[1:]))}] (need down [G, H, I], H a multiple "
                f"of block_k={tuning.block_k} and block_n={tuning.block_n}, I of block_i={tuning.block_i})")
    return None


def grouped_mlp(lhs, gate, up, down, plan: RowPlan, group_starts, *, tuning: GroupedTuning = GroupedTuning(),
                interpret=False):
    """Each sorted row's expert MLP as f32 partials over down's K: lhs [S, H] the rows sorted by group with their
    margin (grouped_matmul_mgpu.margin_rows), gate and up [G, I, H], down [G, H, I], group g's rows
    [group_starts[g], group_starts[g + 1]) -> partials [S, I // block_i, H] f32: summed over axis 1, row r's
    down(silu(gate x) * up x) in f32 with the hidden rounded to lhs's dtype (as the two launches do); rows in no
    group are not written."""
    if why := fused_supported(lhs, gate, down, tuning):
        raise ValueError(f"the fused expert MLP cannot serve this call: {why}")
    blocks_i, hidden = gate.shape[1] // tuning.block_i, down.shape[1]
    partials = plgpu.kernel(
        functools.partial(mlp_kernel, tuning=tuning),
        out_type=jax.ShapeDtypeStruct((lhs.shape[0], blocks_i * hidden), jnp.float32),
        grid=(tuning.num_ctas,), grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )(plan.tile_groups, plan.tile_rows, plan.num_tiles, group_starts, lhs, gate, up, down)
    return partials.reshape(lhs.shape[0], blocks_i, hidden)


def mlp_kernel(tile_groups_ref, tile_rows_ref, num_tiles_ref, group_starts_ref, lhs_ref, gate_ref, up_ref, down_ref,
               out_ref, *, tuning: GroupedTuning):
    """A persistent CTA: work units (tile, i-block), i-blocks fastest (a tile's units on neighbouring CTAs read its
    rows into L2 once), dealt round-robin."""
    blocks_i = gate_ref.shape[1] // tuning.block_i

    @plgpu.nd_loop((num_tiles_ref[0] * blocks_i,), collective_axes="cta")
    def unit(info: plgpu.NDLoopInfo):
        tile, i_block = lax.div(info.index[0], blocks_i), lax.rem(info.index[0], blocks_i)
        group, first = tile_groups_ref[tile], tile_rows_ref[tile]
        own = (jnp.clip(group_starts_ref[group] - first, 0, tuning.block_m),
               jnp.clip(group_starts_ref[group + 1] - first, 0, tuning.block_m))
        rows = lhs_ref.at[pl.ds(pl.multiple_of(first, ROW_ALIGN), tuning.block_m)]
        narrow = replace(tuning, block_n=tuning.block_i)
        products = pl.run_scoped(functools.partial(
            accumulate, lhs_ref=rows, weight_refs=[gate_ref.at[group], up_ref.at[group]], n_block=i_block,
            tuning=narrow), *[plgpu.ACC((tuning.block_m, tuning.block_i))] * 2)
        hidden = jax.nn.silu(products[0]) * products[1]
        pl.run_scoped(functools.partial(down_partials, hidden, down_ref=down_ref.at[group], out_ref=out_ref,
                                        first=first, own=own, i_block=i_block, tuning=tuning),
                      plgpu.SMEM((tuning.block_m, tuning.block_i), lhs_ref.dtype),
                      plgpu.SMEM((2, tuning.block_m, tuning.block_n), jnp.float32))


def down_partials(hidden, hidden_smem, staging, *, down_ref, out_ref, first, own, i_block, tuning: GroupedTuning):
    """hidden [block_m, block_i] times down's block_i columns, block_n of H a step, each product's own rows stored
    (a row a TMA copy) at their sorted rows' partial of this i-block. staging: two f32 tiles, so a step's stores
    run while the next step's product is made."""
    bm, bn, bi = tuning.block_m, tuning.block_n, tuning.block_i
    hidden_smem[...] = hidden.astype(hidden_smem.dtype)
    plgpu.commit_smem()
    column = i_block * down_ref.shape[0]

    def step(indices, weight_smem):
        n_block = indices[0]

        def product(acc_ref):
            plgpu.wgmma(acc_ref, hidden_smem, weight_smem.T)
            return acc_ref[...]

        tile = staging.at[lax.rem(n_block, 2)]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the stores from this tile two steps ago have read it
        tile[...] = pl.run_scoped(product, plgpu.ACC((bm, bn)))
        plgpu.commit_smem()

        @pl.loop(own[0], own[1])
        def _(r):
            plgpu.copy_smem_to_gmem(tile.at[pl.ds(r, 1)],
                                    out_ref.at[pl.ds(first + r, 1), pl.ds(column + n_block * bn, bn)],
                                    commit_group=False)
        plgpu.commit_smem_to_gmem_group()

    plgpu.emit_pipeline(
        step, grid=(down_ref.shape[0] // bn,), in_specs=[plgpu.BlockSpec((bn, bi), lambda n: (n, i_block))],
        max_concurrent_steps=down_depth(tuning, jnp.dtype(hidden_smem.dtype).itemsize),
    )(down_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # staging is free for the next unit


def down_depth(tuning: GroupedTuning, itemsize: int) -> int:
    """Down's ring: its weight tiles in what RING_BYTES leaves beside the hidden tile and the two f32 staging
    tiles."""
    beside = tuning.block_m * (tuning.block_i * itemsize + 2 * tuning.block_n * 4)
    stage = tuning.block_n * tuning.block_i * itemsize
    return max(2, min(tuning.max_concurrent_steps, (RING_BYTES - beside) // stage))


@jax.named_scope("combine")
def combine_partials(partials, pair_rows, tile_rows, weights, block_m: int):
    """Each token's routed sum from grouped_mlp's partials [S, I // block_i, H] (pair_rows [T, k], the routing
    call's padded rows: past the plan for pairs routed nowhere): f32 [T, H]."""
    tiles = tile_rows.shape[0]
    routed = pair_rows < tiles * block_m
    tile = jnp.minimum(pair_rows // block_m, tiles - 1)
    rows = jnp.where(routed, tile_rows[tile] + pair_rows % block_m, partials.shape[0])
    taken = jnp.take(partials, rows, axis=0, mode="fill", fill_value=0)
    return jnp.einsum("tk,tkjh->th", weights, taken)


def grouped_mlp_reference(lhs, gate, up, down, group_sizes):
    """The same MLP by XLA's ragged dots, f32 [M, H]: gate and up in f32, the hidden rounded to lhs's dtype, down
    in f32; rows past sum(group_sizes) zeros."""
    from pallas_kernels.grouped_matmul_mgpu import GROUPED_DOT

    def dot(x, w):
        return lax.ragged_dot_general(x, w, group_sizes, GROUPED_DOT, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(dot(lhs, gate)) * dot(lhs, up)).astype(lhs.dtype)
    return dot(hidden, down)
