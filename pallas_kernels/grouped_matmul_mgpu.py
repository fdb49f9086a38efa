"""Grouped matmul for Hopper (sm_90a): Pallas Mosaic GPU, TMA tiles into wgmma. The mixture of experts' GEMM:
lhs [M, K] rows sorted by group (group g's rows are the next group_sizes[g]), rhs [G, N, K] one weight per group
(as checkpoints store each expert's [out, in]), out [M, N] = each row times its group's weight, transposed.

- The planner (`plan_rows`, in XLA before the launch) cuts each non-empty group into block_m-row tiles, lists the
  tiles that hold rows first and counts them; the launch walks only those (tile, n-block) work units. Empty groups
  have no tile, so at decode sizes (8 pairs over 128 experts) only the routed experts' weights are read, where XLA's
  ragged dot (a dense GEMM over all groups) and a tile per group read them all.
- A tile reads block_m of the sorted rows in place, from its group's next row rounded down to ROW_ALIGN (where a
  TMA box into the tiled SMEM may start), so the lhs is never copied into a padded layout; other groups' rows come
  along and their products are dropped. Each tile's output is stored whole, by TMA, into its own block_m rows of a
  padded output (M_pad = M + min(M, G) * (block_m + ROW_ALIGN - 2) rounded up to block_m: a static bound, so the
  graph keeps static shapes and needs no host trip) with no per-group masking in the kernel; `unpad_rows` gathers
  the rows back. A MoE layer gets its plan from `custom_calls.moe_route` (the router's logits to the plan in one
  CUDA launch) and gathers its tokens straight into the sorted rows with their margin.
- A persistent grid (one CTA per SM) deals the work units round-robin, n-blocks of a tile on neighbouring CTAs (the
  tile's rows are read once into L2). Each unit pipelines K through a TMA ring `max_concurrent_steps` deep into
  wgmma (f32 accumulator) and stores its block_m x block_n tile through SMEM. Where the tiles are too few for
  their units to fill the grid (a decode step's), the n-blocks are block_n_narrow wide, so twice the SMs stream
  the weights: a unit's rate, not the memory's, bounds such a launch.
- Rows past sum(group_sizes) (the pairs another device's experts hold under expert parallelism) are in no tile:
  they are not computed and come out as zeros.

`grouped_swiglu` is an expert's first half in one launch: each work unit accumulates gate and up over the same lhs
tiles (read once) and stores silu(gate) * up in the padded layout, so the two [M, N] products never reach HBM.
`grouped_matmul_padded` takes and gives that layout, so the expert's down projection follows with no gather between;
tiles past the planned count are never written: only rows the plan maps are meaningful there.
"""
import functools
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import mosaic_interpret_params

# rows sorted by group [M, K] . weights [G, N, K] -> [M, N]
GROUPED_DOT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


@dataclass(frozen=True, slots=True)
class GroupedTuning:
    block_m: int = 64  # rows per tile: wgmma's M; also the most padding a group pays
    block_n: int = 128
    # block_n when block_n's units would leave SMs idle and these still fit one round (a decode step's few tiles:
    # at batch 1 each SM streams at most ~75 GB/s, so more SMs each streaming less finish sooner)
    block_n_narrow: int = 64
    block_k: int = 64  # 64 bf16 = one 128-byte swizzled row
    max_concurrent_steps: int = 6  # TMA ring depth; fewer where a stage's tiles would not fit (`pipeline_depth`)
    num_ctas: int = 132  # persistent grid, one CTA per SM (H100/H200); the caller passes the device's core count


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowPlan:
    """The tiles the launch walks (plan_rows, or custom_calls.moe_route straight from a MoE router's logits)."""
    tile_groups: jax.Array  # [num_tiles_max] the group of each tile; past num_tiles: 0, never run
    tile_rows: jax.Array  # [num_tiles_max] the first sorted row each tile reads (a multiple of ROW_ALIGN)
    num_tiles: jax.Array  # [1] tiles that hold rows, listed first


# shared memory the TMA ring may take (H100/H200: 227 KiB a block, the output's staging tile and barriers beside)
RING_BYTES = 200 * 1024


def pipeline_depth(tuning: GroupedTuning, num_weights: int, itemsize: int) -> int:
    """The ring's stages: max_concurrent_steps, or as many as fit RING_BYTES (gate and up stage two weight tiles)."""
    stage = (tuning.block_m + num_weights * tuning.block_n) * tuning.block_k * itemsize
    return max(2, min(tuning.max_concurrent_steps, RING_BYTES // stage))


def supported(lhs, rhs, tuning: GroupedTuning = GroupedTuning()) -> str | None:
    """None when this kernel can serve the shapes, else why not."""
    n, k = rhs.shape[1:]
    if lhs.dtype not in (jnp.bfloat16, jnp.float16) or rhs.dtype != lhs.dtype:
        return f"dtypes {lhs.dtype}, {rhs.dtype} (needs bfloat16 or float16, both the same)"
    if k % tuning.block_k or n % tuning.block_n or n % tuning.block_n_narrow:
        return (f"K={k}, N={n} (need multiples of block_k={tuning.block_k}, block_n={tuning.block_n} and "
                f"block_n_narrow={tuning.block_n_narrow})")
    return None


# the lhs tile's SMEM tiling holds 8 rows: a TMA box into it starts on a multiple of 8 rows
ROW_ALIGN = 8


def num_tiles_max(num_rows: int, num_groups: int, block_m: int) -> int:
    """Tiles a plan can need: each non-empty group (at most min(M, G)) starts up to ROW_ALIGN - 1 rows into its
    first tile and rounds its last up by < block_m rows."""
    return pl.cdiv(num_rows + min(num_rows, num_groups) * (block_m - 1 + ROW_ALIGN - 1), block_m)


def margin_rows(num_rows: int, block_m: int) -> int:
    """Rows the sorted rows take with their margin: a group's last tile reads up to block_m - 1 rows past the group,
    which must exist (on the GPU a TMA box past the array reads zeros, the interpreter would shift the slice back);
    TMA into the tiled SMEM also wants whole ROW_ALIGN tiles of rows."""
    return num_rows + block_m + -num_rows % ROW_ALIGN


def plan_rows(group_sizes, num_rows: int, block_m: int) -> tuple[RowPlan, jax.Array]:
    """The tiles of `num_rows` rows sorted into groups of `group_sizes`, and each row's padded position (slots [M];
    M_pad for rows in no group): group g's tiles (from tile_start[g] on; empty groups take none) read block_m rows
    each from its first row rounded down to ROW_ALIGN, and its row r lands at padded position
    tile_start[g] * block_m + r - that rounded row."""
    sizes = group_sizes.astype(jnp.int32)
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    base = row_start - row_start % ROW_ALIGN
    group_tiles = jnp.where(sizes > 0, pl.cdiv(row_end - base, block_m), 0)
    tile_end = jnp.cumsum(group_tiles)
    tile_start = tile_end - group_tiles
    tiles = num_tiles_max(num_rows, sizes.shape[0], block_m)
    # searches as one fused compare: searchsorted's default is a while loop, a device-to-host sync an iteration
    # on the GPU (for every MoE layer of every step)
    tile = jnp.arange(tiles)
    tile_groups = jnp.searchsorted(tile_end, tile, side="right", method="compare_all")
    planned = tile_groups < sizes.shape[0]
    tile_groups = jnp.where(planned, tile_groups, 0).astype(jnp.int32)
    tile_rows = jnp.where(planned, base[tile_groups] + (tile - tile_start[tile_groups]) * block_m, 0)
    row = jnp.arange(num_rows)
    group = jnp.searchsorted(row_end, row, side="right", method="compare_all")
    in_group = group < sizes.shape[0]
    group = jnp.minimum(group, sizes.shape[0] - 1)
    slots = jnp.where(in_group, tile_start[group] * block_m + row - base[group], tiles * block_m)
    return RowPlan(tile_groups, tile_rows.astype(jnp.int32), tile_end[-1:]), slots.astype(jnp.int32)


def unpad_rows(y, slots):
    """[M_pad, ...] padded rows back to [M, ...] by plan_rows' slots; rows in no group zeros."""
    return jnp.take(y, slots, axis=0, mode="fill", fill_value=0)


def grouped_matmul(lhs, rhs, group_sizes, *, tuning: GroupedTuning = GroupedTuning(), interpret=False):
    """lhs [M, K] sorted by group, rhs [G, N, K], group_sizes [G] -> [M, N] in lhs's dtype (f32 accumulation);
    rows past sum(group_sizes) are zeros."""
    plan, slots = plan_rows(group_sizes, lhs.shape[0], tuning.block_m)
    return unpad_rows(launch(with_margin(lhs, tuning), (rhs,), plan, plan.tile_rows, tuning, interpret), slots)


def grouped_swiglu(lhs, gate, up, plan: RowPlan, *, tuning: GroupedTuning = GroupedTuning(), interpret=False):
    """silu(lhs . gate_g) * (lhs . up_g) in one launch: lhs [margin_rows(M), K] the rows sorted by group, then their
    margin (any values), gate and up [G, N, K] -> [M_pad, N] in `plan`'s padded layout, in lhs's dtype (f32 products
    and activation), the planned tiles written."""
    return launch(lhs, (gate, up), plan, plan.tile_rows, tuning, interpret)


def grouped_matmul_padded(lhs, rhs, plan: RowPlan, *, tuning: GroupedTuning = GroupedTuning(), interpret=False):
    """lhs [M_pad, K] in `plan`'s padded layout -> [M_pad, N], the planned tiles written, the rest left as they
    were allocated."""
    starts = jnp.arange(plan.tile_rows.shape[0], dtype=jnp.int32) * tuning.block_m
    return launch(lhs, (rhs,), plan, starts, tuning, interpret)


def with_margin(lhs, tuning: GroupedTuning):
    """Sorted rows [M, K] with their margin of zeros: [margin_rows(M), K]."""
    return jnp.pad(lhs, ((0, margin_rows(lhs.shape[0], tuning.block_m) - lhs.shape[0]), (0, 0)))


def launch(lhs, weights, plan: RowPlan, tile_rows, tuning: GroupedTuning, interpret):
    """One grouped launch over `weights` (one: its product; gate and up: silu(gate) * up), tile t reading lhs rows
    from tile_rows[t] on, into the padded layout."""
    why_not = next(filter(None, (supported(lhs, w, tuning) for w in weights)), None)
    if why_not:
        raise ValueError(f"the grouped GEMM cannot serve this call: {why_not}")
    kernel = functools.partial(grouped_kernel, tuning=tuning)
    padded_rows = plan.tile_groups.shape[0] * tuning.block_m
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((padded_rows, weights[0].shape[1]), lhs.dtype),
        grid=(tuning.num_ctas,), grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )(plan.tile_groups, tile_rows, plan.num_tiles, lhs, *weights)


def grouped_kernel(tile_groups_ref, tile_rows_ref, num_tiles_ref, lhs_ref, *refs, tuning: GroupedTuning):
    """A persistent CTA: work units (tile, n-block), n-blocks fastest, dealt round-robin over the CTAs; n-blocks of
    block_n_narrow columns where block_n's would leave SMs idle and those still fit one round. refs: the weights
    (one, or gate and up), then the output."""
    *weight_refs, out_ref = refs
    n, num_tiles = weight_refs[0].shape[1], num_tiles_ref[0]
    narrow = narrow_units(num_tiles, n, tuning)
    grid_n = jnp.where(narrow, n // tuning.block_n_narrow, n // tuning.block_n)

    @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="cta")
    def unit(info: plgpu.NDLoopInfo):
        tile, n_block = lax.div(info.index[0], grid_n), lax.rem(info.index[0], grid_n)
        run = functools.partial(run_unit, tile_groups_ref, tile_rows_ref, lhs_ref, weight_refs, out_ref, tile, n_block)
        lax.cond(narrow, functools.partial(run, tuning=replace(tuning, block_n=tuning.block_n_narrow)),
                 functools.partial(run, tuning=tuning))


def narrow_units(num_tiles, n: int, tuning: GroupedTuning):
    """Whether a launch of num_tiles tiles over N=n runs n-blocks of block_n_narrow columns: all of its units then
    fit one round of the persistent grid."""
    return num_tiles * (n // tuning.block_n_narrow) <= tuning.num_ctas


def run_unit(tile_groups_ref, tile_rows_ref, lhs_ref, weight_refs, out_ref, tile, n_block, *,
             tuning: GroupedTuning):
    """Work unit (tile, n_block) of tuning.block_n columns: its products into the padded output."""
    bm, bn = tuning.block_m, tuning.block_n
    group = tile_groups_ref[tile]
    rows = lhs_ref.at[pl.ds(pl.multiple_of(tile_rows_ref[tile], ROW_ALIGN), tuning.block_m)]
    products = pl.run_scoped(functools.partial(
        accumulate, lhs_ref=rows, weight_refs=[w.at[group] for w in weight_refs], n_block=n_block, tuning=tuning),
        *[plgpu.ACC((bm, bn))] * len(weight_refs))
    result = products[0] if len(products) == 1 else jax.nn.silu(products[0]) * products[1]
    pl.run_scoped(functools.partial(store, result, out_ref=out_ref, tile=tile, n_block=n_block, tuning=tuning),
                  plgpu.SMEM((bm, bn), out_ref.dtype))


def accumulate(*acc_refs, lhs_ref, weight_refs, n_block, tuning: GroupedTuning):
    """The unit's [block_m, block_n] f32 products, one per weight: K in block_k steps, TMA copies
    `max_concurrent_steps` ahead of wgmma, each lhs tile read once for all weights. lhs_ref: the tile's rows
    [block_m, K]; weight_refs: its group's weights [N, K]."""
    bm, bn, bk = tuning.block_m, tuning.block_n, tuning.block_k

    def step(_, lhs_smem, *weight_smems):
        for acc_ref, weight_smem in zip(acc_refs, weight_smems):
            plgpu.wgmma(acc_ref, lhs_smem, weight_smem.T)

    plgpu.emit_pipeline(
        step, grid=(lhs_ref.shape[1] // bk,),
        # wgmma runs asynchronously: a step's buffers are released one step later, once it has completed
        in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (0, k), delay_release=1),
                  *[plgpu.BlockSpec((bn, bk), lambda k: (n_block, k), delay_release=1)] * len(weight_refs)],
        max_concurrent_steps=pipeline_depth(tuning, len(weight_refs), jnp.dtype(lhs_ref.dtype).itemsize),
    )(lhs_ref, *weight_refs)
    return [acc_ref[...] for acc_ref in acc_refs]


def store(acc, staging, *, out_ref, tile, n_block, tuning: GroupedTuning):
    """The unit's tile into the padded output, whole, by TMA through `staging`; waits until the copy has read
    `staging`, which the next unit reuses."""
    bm, bn = tuning.block_m, tuning.block_n
    staging[...] = acc.astype(staging.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, out_ref.at[pl.ds(tile * bm, bm), pl.ds(n_block * bn, bn)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """The same product by XLA's ragged dot (f32 accumulation); rows past sum(group_sizes) are zeros."""
    return lax.ragged_dot_general(lhs, rhs, group_sizes, GROUPED_DOT,
                                  preferred_element_type=jnp.float32).astype(lhs.dtype)
