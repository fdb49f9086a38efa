"""The Mosaic GPU grouped matmul against XLA's ragged dot: interpreted on the CPU (Mosaic GPU's warpgroup
interpreter, 4 CTAs, each walking several work units), compiled on an H100/H200; its row plan; its lowering for
CUDA; the experts' MLP through it.

Interpreted, every buffer the kernel allocates starts as NaN (the interpreter's default), on a GPU the allocator is
handed NaN buffers first: an unwritten tile or a tile read from the wrong rows shows up as NaN, which never passes.
Tolerance: both sides accumulate bf16/f16 products (exact in f32) in f32, in different orders (~1e-6 relative),
then round to the output dtype: the kernel's output is held to 2^-8 relative (the rounding, with a margin) of the
f32 reference, plus 1e-3 absolute for sums that cancel.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul_mgpu as gmm
import custom_calls
from jaxserve.models.llama import EXPERT_DOT, mosaic_experts, ragged_experts, routed_experts

from helpers import on_gpu, on_hopper

ON_GPU = on_gpu()
pytestmark = pytest.mark.skipif(ON_GPU and not on_hopper(), reason="the Mosaic GPU grouped matmul needs sm_90")
TUNING = gmm.GroupedTuning(num_ctas=132 if ON_GPU else 4)
# grids for either n-block width (gmm.narrow_units): 4 CTAs, where these cases' tiles take block_n columns, and one
# wide enough for a few tiles to take block_n_narrow (on the GPU the device's)
GRIDS = {"wide": gmm.GroupedTuning(num_ctas=4), "narrow": gmm.GroupedTuning(num_ctas=132 if ON_GPU else 16)}


def operands(rng, num_rows, k, n, num_groups, dtype=jnp.bfloat16):
    lhs = jnp.asarray(rng.standard_normal((num_rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((num_groups, n, k)) / np.sqrt(k), dtype)
    return lhs, rhs


def reference_f32(lhs, rhs, group_sizes):
    return np.asarray(jax.lax.ragged_dot_general(lhs, rhs, group_sizes, gmm.GROUPED_DOT,
                                                 preferred_element_type=jnp.float32))


def poison(shape, dtype):
    """On a GPU, free a few NaN buffers of the output's size so an unwritten tile likely reads NaN."""
    if ON_GPU:
        for _ in range(3):
            jnp.full(shape, jnp.nan, dtype).block_until_ready().delete()


def check_close(out, expected, label, rtol=2 ** -8, atol=1e-3):
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any(), f"{label}: NaN at rows {np.unique(np.nonzero(np.isnan(out))[0])}"
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol, err_msg=label)


def f32(*arrays):
    return [a.astype(jnp.float32) for a in arrays]


# The MLP's bf16 hidden activations (one rounding, 2^-9 relative) carried through down's 128-term sums: ~1e-3
# absolute at these magnitudes (outputs ~0.5), held to 4e-3; 2^-7 relative for the output's own rounding.
MLP_TOLERANCE = {"rtol": 2 ** -7, "atol": 4e-3}


def decode_sizes(rng, rows=8, groups=128):
    """`rows` rows in distinct groups of `groups`, one each: batch 1's top-8 of 128 experts."""
    sizes = np.zeros(groups, np.int32)
    sizes[rng.choice(groups, rows, replace=False)] = 1
    return sizes


def expect_units(grid: str, num_tiles: int, n: int) -> gmm.GroupedTuning:
    """GRIDS[grid], checked to run num_tiles tiles over N=n in n-blocks of that width."""
    tuning = GRIDS[grid]
    assert bool(gmm.narrow_units(num_tiles, n, tuning)) == (grid == "narrow")
    return tuning


@pytest.mark.parametrize("sizes, num_rows, k, n, dtype, grid", [
    # empty groups; one over a tile; 2 rows in no group; 4 (wide) n-blocks
    ([30, 0, 65, 0, 3], 100, 128, 256, jnp.bfloat16, "wide"),
    ([0, 0, 150, 0], 150, 256, 128, jnp.float16, "wide"),  # all rows one group; M not a multiple of block_m
    ("decode", 8, 128, 128, jnp.bfloat16, "wide"),  # 8 rows over 128 groups, one row each
    ("decode", 8, 128, 128, jnp.bfloat16, "narrow"),
    ([0, 5, 0, 40], 45, 128, 256, jnp.bfloat16, "narrow"),  # 2 tiles, each of 4 narrow n-blocks
    ([0, 0, 0], 20, 128, 128, jnp.bfloat16, "narrow"),  # no group holds a row: nothing runs, all zeros
])
def test_matches_reference(sizes, num_rows, k, n, dtype, grid):
    rng = np.random.default_rng(len(str(sizes)) + num_rows)
    sizes = jnp.asarray(decode_sizes(rng) if sizes == "decode" else sizes, jnp.int32)
    tuning = expect_units(grid, int(gmm.plan_rows(sizes, num_rows, 64)[0].num_tiles[0]), n)
    lhs, rhs = operands(rng, num_rows, k, n, sizes.shape[0], dtype)
    expected = reference_f32(lhs, rhs, sizes)
    poison((num_rows, n), dtype)
    out = jax.jit(functools.partial(gmm.grouped_matmul, tuning=tuning, interpret=not ON_GPU))(lhs, rhs, sizes)
    assert out.dtype == dtype
    check_close(out, expected, f"sizes {sizes.tolist()}")
    assert not np.asarray(out[int(sizes.sum()):], np.float32).any()  # rows in no group: zeros


def test_random_groups_against_the_library_reference():
    """Random sizes over 6 groups (some empty), the module's reference (ragged dot, rounded to bf16) as oracle."""
    rng = np.random.default_rng(11)
    sizes = rng.multinomial(90, rng.dirichlet(np.full(6, 0.5)))
    sizes[rng.choice(6, 2, replace=False)] = 0
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = operands(rng, 96, 128, 128, 6)
    expected = np.asarray(gmm.grouped_matmul_reference(lhs, rhs, sizes), np.float32)
    out = gmm.grouped_matmul(lhs, rhs, sizes, tuning=TUNING, interpret=not ON_GPU)
    # both round nearly the same f32 sums to bf16: at most one bf16 ulp (2^-7 relative) apart
    check_close(out, expected, f"sizes {sizes.tolist()}", rtol=2 ** -7)


def test_empty_groups_get_no_tile():
    """Only groups holding rows are in the plan's tile list (so only their weights are read): 8 rows over 128
    groups run 8 tiles; a group takes the tiles its rows span from its first row rounded down to 8 (TMA boxes start
    on 8 rows), in group order."""
    rng = np.random.default_rng(3)
    sizes = decode_sizes(rng)
    plan, slots = gmm.plan_rows(jnp.asarray(sizes), 8, 64)
    num_tiles = int(plan.num_tiles[0])
    assert num_tiles == 8 and plan.tile_groups.shape[0] >= 8
    assert plan.tile_groups[:num_tiles].tolist() == np.nonzero(sizes)[0].tolist()
    assert plan.tile_rows[:num_tiles].tolist() == [0] * 8   # each reads rows 0-63, its own row at its place
    assert slots.tolist() == [t * 64 + t for t in range(8)]
    sizes = np.zeros(128, np.int32)
    sizes[[5, 70]] = [3, 130]
    plan, slots = gmm.plan_rows(jnp.asarray(sizes), 140, 64)
    num_tiles = int(plan.num_tiles[0])
    assert plan.tile_groups[:num_tiles].tolist() == [5, 70, 70, 70]   # rows 3-132 from row 0 span 3 tiles
    assert plan.tile_rows[:num_tiles].tolist() == [0, 0, 64, 128]
    assert int(slots[2]) == 2 and int(slots[3]) == 67  # group 70's tiles start at padded row 64
    assert (np.asarray(slots[133:]) == plan.tile_rows.shape[0] * 64).all()  # rows in no group: nowhere


def test_unpad_gathers_each_planned_row():
    """Row r of group g sits at padded position slots[r] (its tile's start plus its place in the tile); unpad_rows
    gathers every row in a group back from there, zeros for the rest."""
    sizes = jnp.asarray([0, 5, 0, 64, 1], jnp.int32)
    plan, slots = gmm.plan_rows(sizes, 80, 64)
    tiles = plan.tile_groups.shape[0]
    padded = np.full((tiles * 64, 2), np.nan, np.float32)
    for t in range(int(plan.num_tiles[0])):   # what the kernel stores: tile t's rows in its own block_m rows
        group_end = int(np.cumsum(sizes)[int(plan.tile_groups[t])])
        rows = np.arange(int(plan.tile_rows[t]), min(int(plan.tile_rows[t]) + 64, group_end))
        padded[t * 64:t * 64 + len(rows)] = np.stack([rows, -rows], axis=1) + 1
    back = np.asarray(gmm.unpad_rows(jnp.asarray(padded), slots))
    np.testing.assert_array_equal(back[:70], np.stack([np.arange(70), -np.arange(70)], axis=1) + 1)
    assert not back[70:].any()


# Qwen3-30B-A3B's gate/up and down; rows off the TMA's 8-row tiling
@pytest.mark.parametrize("num_rows, k, n", [(64, 2048, 768), (64, 768, 2048), (10, 128, 128)])
def test_lowers_for_cuda(num_rows, k, n):
    """Lowered for an NVIDIA GPU (here without one): Mosaic GPU's layout inference and lowering run, one Mosaic GPU
    kernel comes out."""
    shapes = [((num_rows, k), jnp.bfloat16), ((128, n, k), jnp.bfloat16), ((128,), jnp.int32)]
    fn = functools.partial(gmm.grouped_matmul, tuning=gmm.GroupedTuning())
    text = jax.jit(fn).trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("grid", ["wide", "narrow"])
def test_swiglu_matches_reference(grid):
    """Gate and up in one launch with the activation: silu(x . gate) * (x . up) of the f32 ragged dots, rounded once;
    the 8-rows-over-128-groups decode shape and a mix of empty and multi-tile groups, in wide and narrow n-blocks."""
    rng = np.random.default_rng(12)
    cases = {"wide": ((decode_sizes(rng), 8, 256), (np.asarray([70, 0, 5, 0], np.int32), 80, 256)),
             "narrow": ((decode_sizes(rng), 8, 128), (np.asarray([0, 0, 5, 0], np.int32), 5, 256))}[grid]
    for sizes, num_rows, n in cases:
        sizes = jnp.asarray(sizes)
        lhs, gate = operands(rng, num_rows, 128, n, sizes.shape[0])
        up = operands(rng, 1, 128, n, sizes.shape[0])[1]
        g, u = reference_f32(lhs, gate, sizes), reference_f32(lhs, up, sizes)
        expected = g / (1 + np.exp(-g)) * u
        plan, slots = gmm.plan_rows(sizes, num_rows, TUNING.block_m)
        tuning = expect_units(grid, int(plan.num_tiles[0]), n)
        swiglu = functools.partial(gmm.grouped_swiglu, plan=plan, tuning=tuning, interpret=not ON_GPU)
        out = gmm.unpad_rows(jax.jit(swiglu)(gmm.with_margin(lhs, tuning), gate, up), slots)
        check_close(out[:int(sizes.sum())], expected[:int(sizes.sum())], f"swiglu {sizes.shape[0]} groups, {grid}")


def test_swiglu_lowers_for_cuda():
    """Qwen3-30B-A3B's gate and up (768 x 2048) with the activation: one Mosaic GPU kernel."""
    plan, _ = gmm.plan_rows(jnp.zeros(128, jnp.int32), 64, 64)
    fn = functools.partial(gmm.grouped_swiglu, plan=plan)
    lhs = jax.ShapeDtypeStruct((gmm.margin_rows(64, 64), 2048), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16)
    text = jax.jit(fn).trace(lhs, weight, weight).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["mosaic_gpu_v2"]


def test_expert_block_lowers_to_three_launches(monkeypatch):
    """The whole expert block as the engine runs it on Hopper, lowered for CUDA: one routing call (the router's
    logits to the plan), then two Mosaic GPU launches (gate and up with the activation, then down); no sort, no
    while loop (on the GPU each iteration syncs with the host), no pad (the tokens are gathered straight into the
    sorted rows with their margin; the padded hidden goes to down as it is)."""
    monkeypatch.setattr(custom_calls, "available", lambda: True)   # the CUDA path, as on an H100
    e, h, i, tokens, k = 128, 2048, 768, 16, 8
    spec = jax.ShapeDtypeStruct
    block = functools.partial(routed_experts, top_k=k, renormalize=True, split=False, backend="mosaic")
    text = jax.jit(block).trace(spec((tokens, h), jnp.bfloat16), spec((tokens, e), jnp.bfloat16),
                                spec((1,), jnp.int32), spec((e, i, h), jnp.bfloat16),
                                spec((e, i, h), jnp.bfloat16), spec((e, h, i), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["jaxserve_moe_route"] + ["mosaic_gpu_v2"] * 2
    for op in ("stablehlo.while", "stablehlo.sort", "stablehlo.pad"):
        assert op not in text, op


def test_ring_fits_shared_memory():
    """The TMA ring is as deep as asked where its stages fit (one weight: 24 KiB a stage in bf16), shallower for
    gate and up (40 KiB a stage): 6 of those would overflow the 227 KiB a block has."""
    tuning = gmm.GroupedTuning()
    assert gmm.pipeline_depth(tuning, 1, 2) == tuning.max_concurrent_steps == 6
    assert gmm.pipeline_depth(tuning, 2, 2) == 5
    assert 5 * 40 * 1024 + 64 * 128 * 2 <= 227 * 1024   # with the output's staging tile


def test_refuses_shapes_it_cannot_serve():
    lhs, rhs = operands(np.random.default_rng(0), 8, 128, 96, 2)
    with pytest.raises(ValueError, match="N=96"):
        gmm.grouped_matmul(lhs, rhs, jnp.asarray([4, 4], jnp.int32), tuning=TUNING, interpret=True)


def router_case(rng, tokens, experts, hidden=128, inter=128, local=None):
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32)
    local = local or experts
    gate, up = (jnp.asarray(rng.standard_normal((local, inter, hidden)) / np.sqrt(hidden), jnp.bfloat16)
                for _ in range(2))
    down = jnp.asarray(rng.standard_normal((local, hidden, inter)) / np.sqrt(inter), jnp.bfloat16)
    return x, logits, gate, up, down


@pytest.mark.parametrize("num_live, expert_base", [(5, 0), (3, 2)], ids=["all_live", "padding_and_another_device"])
def test_mosaic_experts_match_ragged_dot(num_live, expert_base):
    """The routed sum through the routing call and the Mosaic GPU launches equals the float32 ragged-dot one:
    5 tokens' top 2 of 8 experts, this device holding experts expert_base .. + 5 (pairs routed to the others add
    nothing) and padding tokens past num_live (zeros, not NaN)."""
    rng = np.random.default_rng(4)
    x, logits, gate, up, down = router_case(rng, 5, 8, local=6 if expert_base else None)
    live, base = jnp.asarray([num_live], jnp.int32), jnp.asarray([expert_base], jnp.int32)
    options = {"top_k": 2, "renormalize": True}
    expected = np.asarray(ragged_experts(*f32(x), logits, live, base, *f32(gate, up, down), **options))
    out = mosaic_experts(x, logits, live, base, gate, up, down, **options, tuning=TUNING, interpret=not ON_GPU)
    check_close(out, expected, "experts' MLP", **MLP_TOLERANCE)
    assert not np.asarray(out[num_live:]).any() and np.asarray(out[:num_live]).any()


def test_routed_experts_on_mosaic():
    """The whole expert block, 5 tokens' top 2 of 8 experts, through the kernel and through XLA's ragged dot."""
    rng = np.random.default_rng(5)
    x, logits, gate, up, down = router_case(rng, 5, 8)
    options = {"top_k": 2, "renormalize": False, "split": False}
    expected = np.asarray(routed_experts(*f32(x), logits, jnp.asarray([5]), *f32(gate, up, down), **options,
                                         backend="xla"))
    out = routed_experts(x, logits, jnp.asarray([5]), gate, up, down, **options, backend="mosaic",
                         interpret=not ON_GPU)
    check_close(out, expected, "expert block", **MLP_TOLERANCE)


def test_auto_keeps_ragged_dot_off_hopper():
    from jaxserve.models.llama import grouped_gemm_tuning
    lhs, rhs = operands(np.random.default_rng(0), 8, 128, 128, 2)
    assert (grouped_gemm_tuning("auto", False, lhs, rhs, rhs) is None) == (not on_hopper())
    assert EXPERT_DOT == gmm.GROUPED_DOT
