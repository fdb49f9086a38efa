"""Cascade attention: decode rows that share leading blocks, their prefix read once per group.

The kernel (interpreted on the CPU, compiled on a GPU) and the reference against float64 numpy attention over each
row's whole context. The batches are built so that only the cascade's own addressing gives the right answer: after
the expected output is computed, every grouped row's table entries for the shared blocks are pointed at a NaN page,
except the row the group names (`table_rows`), so a shared pass reading the wrong table, or a row's own pass reading
its shared keys again, comes out NaN. Rows are in random order (groups are not contiguous), groups end mid-tile,
rows outside every group and padding rows sit between them.
"""
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls
from jaxserve import LLM, SamplingParams
from jaxserve.engine.step_graphs import (CASCADE_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS, CASCADE_MOSAIC_MIN_MEMBERS,
                                        apply_cascade_rule, cascade_rule)
from jaxserve.engine.step_inputs import share_prefixes
from jaxserve.models.attention import AttentionKernels
from jaxserve.models.loader import random_model
from pallas_kernels.cascade_attention import CascadeGroups, cascade_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

from helpers import (KNOBS, TINY, Batch, check_close, interpret_tuning, mixed_requests, naive_attention, on_gpu,
                     on_hopper, poison_allocator, without_triton)

INTERPRET = not on_gpu()
GEOMETRY = {"q_heads": 8, "kv_heads": 2, "head_dim": 64, "block_size": 16, "max_seqs": 16, "max_blocks": 12,
            "num_blocks": 160, "max_groups": 4}
# ([(shared blocks, [own tokens of each member])], [kv_len of each row outside every group])
LAYOUTS = {
    "one_group": ([(4, [1, 9, 16, 17, 30, 2, 5])], [40, 3]),
    "several": ([(2, [3, 20]), (7, [1, 1, 12]), (1, [33, 8, 16, 4, 60])], [1, 99]),
    "no_group": ([], [17, 64, 5]),
}


def make_cascade_batch(rng, groups, loners, *, q_heads, kv_heads, head_dim, block_size, max_seqs, max_blocks,
                       num_blocks, max_groups, dtype=jnp.float32, cache_dtype=None, **options):
    """(Batch decode-only, CascadeGroups, the float64 expected output under `options` over the caches as stored in
    cache_dtype (default: dtype)), the tables already poisoned (see the module)."""
    members = [(g, own) for g, (_, owns) in enumerate(groups) for own in owns]
    num_rows = len(members) + len(loners)
    order = rng.permutation(num_rows)   # row of each member, then of each loner
    pages = iter(rng.permutation(np.arange(2, num_blocks)))   # page 1: the NaN page
    cache = np.full((2, num_blocks, block_size, kv_heads, head_dim), np.nan, np.float32)
    tables = rng.integers(-5, 1 << 20, (max_seqs, max_blocks)).astype(np.int32)
    kv_lens = rng.integers(1 << 20, 1 << 21, max_seqs).astype(np.int32)

    def fill(row, first_col, num_tokens):
        for col in range(first_col, first_col + -(-num_tokens // block_size)):
            tables[row, col] = page = next(pages)
            filled = min(block_size, num_tokens - (col - first_col) * block_size)
            cache[:, page, :filled] = rng.standard_normal((2, filled, kv_heads, head_dim))

    shared_tables = []
    for shared, _ in groups:
        shared_tables.append([next(pages) for _ in range(shared)])
        cache[:, shared_tables[-1]] = rng.standard_normal((2, shared, block_size, kv_heads, head_dim))
    for row, (g, own) in zip(order, members):
        tables[row, :groups[g][0]] = shared_tables[g]
        fill(row, groups[g][0], own)
        kv_lens[row] = groups[g][0] * block_size + own
    for row, n in zip(order[len(members):], loners):
        fill(row, 0, n)
        kv_lens[row] = n
    q = rng.standard_normal((max_seqs, q_heads, head_dim)).astype(np.float32)
    cache_dtype = cache_dtype or dtype
    batch = Batch(jnp.asarray(q, dtype), jnp.asarray(cache[0], cache_dtype), jnp.asarray(cache[1], cache_dtype),
                  jnp.minimum(jnp.arange(max_seqs + 1, dtype=jnp.int32), num_rows), jnp.asarray(kv_lens),
                  jnp.asarray(tables), jnp.asarray([num_rows], jnp.int32), num_rows)
    expected = naive_attention(batch, sm_scale=0.125, **options)
    group_rows = [[row for row, (g, _) in zip(order, members) if g == i] for i in range(len(groups))]
    kv_starts = np.zeros(max_seqs, np.int32)
    for i, (shared, _) in enumerate(groups):
        kv_starts[group_rows[i]] = shared * block_size
        tables[group_rows[i][1:], :shared] = 1   # the NaN page: only table_rows[i] (its first member) holds them
    cu = np.cumsum([0] + [len(r) for r in group_rows] + [0] * (max_groups - len(groups)))
    cascade = CascadeGroups(
        jnp.asarray(kv_starts), jnp.asarray(np.resize(np.concatenate([*group_rows, [0]]), max_seqs).astype(np.int32)),
        jnp.asarray(cu, jnp.int32), jnp.asarray([s * block_size for s, _ in groups] + [0] * (max_groups - len(groups)),
                                                jnp.int32),
        jnp.asarray([r[0] for r in group_rows] + [0] * (max_groups - len(groups)), jnp.int32),
        jnp.asarray([len(groups)], jnp.int32))
    return Batch(*batch.args()[:5], jnp.asarray(tables), batch.num_seqs, num_rows), cascade, expected


def run(batch: Batch, cascade: CascadeGroups, **options):
    return cascade_attention(batch.q, batch.k_cache, batch.v_cache, batch.kv_lens, batch.block_tables,
                             batch.num_seqs, cascade, sm_scale=0.125, **options)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_matches_float64(layout):
    batch, cascade, expected = make_cascade_batch(np.random.default_rng(0), *LAYOUTS[layout], **GEOMETRY)
    check_close(run(batch, cascade, impl="reference"), expected, batch, jnp.float32, layout)


def test_poisoned_tables_break_plain_attention():
    """The batches test the cascade's addressing: plain attention over the same tables reads the NaN page."""
    batch, _, _ = make_cascade_batch(np.random.default_rng(0), *LAYOUTS["one_group"], **GEOMETRY)
    out = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125)
    assert np.isnan(np.asarray(out[:batch.live_tokens])).any()


@pytest.mark.parametrize("dtype, tuning, options", [
    (jnp.float32, {}, {}),
    # 4 splits a row; 16 splits of the shared keys, most of them empty
    (jnp.float32, {"decode_programs": 128, "decode_kv_tile": 16}, {"soft_cap": 5.0}),
    (jnp.bfloat16, {}, {}),
    # 4 members a shared tile, tiles of 2 pages, 3 uneven splits of the shared keys
    (jnp.bfloat16, {"prefill_block_m": 16, "prefill_kv_tile": 32, "cascade_programs": 24}, {}),
])
def test_kernel_matches_float64(dtype, tuning, options):
    rng = np.random.default_rng(1)
    for layout, (groups, loners) in LAYOUTS.items():
        batch, cascade, expected = make_cascade_batch(rng, groups, loners, **GEOMETRY, dtype=dtype, **options)
        poison_allocator(batch)
        out = run(batch, cascade, impl="pallas", interpret=INTERPRET, **options, **(tuning or interpret_tuning()))
        check_close(out, expected, batch, dtype, layout)


@pytest.mark.skipif(on_gpu() and not on_hopper(), reason="the Mosaic GPU decode kernel needs sm_90")
@pytest.mark.parametrize("cache_dtype, options", [(jnp.bfloat16, {}), (jnp.float8_e4m3fn, {"soft_cap": 5.0})])
@pytest.mark.parametrize("own_partials", [None, custom_calls.paged_decode_partials], ids=["own-mosaic", "own-call"])
def test_mosaic_kernel_matches_float64(cache_dtype, options, own_partials):
    """Both passes on the Mosaic GPU decode kernel (decode_backend="mosaic"), bf16 q: a group's members packed 16 to
    a shared tile (4 q heads a kv head), the own passes through shifted tables; or the own passes through the CUDA
    call's unmerged splits (the engine's own_partials on Hopper; its reference without the library). An e4m3 cache
    is held to attention over its own values (exact in the kernels' float16), so bf16's tolerance holds. Padding
    rows (garbage lengths and tables) come out as zeros."""
    rng = np.random.default_rng(3)
    for layout, (groups, loners) in LAYOUTS.items():
        batch, cascade, expected = make_cascade_batch(rng, groups, loners, **GEOMETRY, dtype=jnp.bfloat16,
                                                      cache_dtype=cache_dtype, **options)
        poison_allocator(batch)
        out = run(batch, cascade, impl="pallas", decode_backend="mosaic", interpret=INTERPRET,
                  own_partials=own_partials, **options)
        check_close(out, expected, batch, jnp.bfloat16, layout)
        assert not np.asarray(out[batch.live_tokens:], np.float32).any(), layout


def test_mosaic_cascade_lowers_for_cuda():
    """Llama-3-8B's heads (32 q, 8 kv, head_dim 128) lowered for CUDA (here without a GPU: Mosaic GPU's layout
    inference runs, which the interpreter skips): two Mosaic GPU launches, the shared pass's tile full (16 members x
    4 q heads), and no Triton kernel."""
    import re

    import jax
    rows, groups = 64, 8
    shapes = [((rows, 32, 128), jnp.bfloat16), ((512, 16, 8, 128), jnp.bfloat16), ((512, 16, 8, 128), jnp.bfloat16),
              ((rows,), jnp.int32), ((rows, 32), jnp.int32), ((1,), jnp.int32), ((rows,), jnp.int32),
              ((rows,), jnp.int32), ((groups + 1,), jnp.int32), ((groups,), jnp.int32), ((groups,), jnp.int32),
              ((1,), jnp.int32)]

    def attend(q, k_cache, v_cache, kv_lens, tables, num_seqs, *cascade):
        return cascade_attention(q, k_cache, v_cache, kv_lens, tables, num_seqs, CascadeGroups(*cascade),
                                 sm_scale=0.125, impl="pallas", decode_backend="mosaic")

    text = jax.jit(attend).trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["mosaic_gpu_v2"] * 2


def test_rejects_malformed_groups():
    batch, cascade, _ = make_cascade_batch(np.random.default_rng(2), *LAYOUTS["one_group"], **GEOMETRY)
    bad = CascadeGroups(cascade.kv_starts[:3], cascade.rows, cascade.cu_rows, cascade.shared_lens, cascade.table_rows,
                        cascade.num_groups)
    with pytest.raises(ValueError, match=r"groups.kv_starts must be int32 \[16\]"):
        run(batch, bad, impl="reference")
    bad = CascadeGroups(cascade.kv_starts, cascade.rows, cascade.cu_rows[:-1], cascade.shared_lens,
                        cascade.table_rows, cascade.num_groups)
    with pytest.raises(ValueError, match=r"groups.cu_rows must be int32 \[5\]"):
        run(batch, bad, impl="reference")


# ---- the engine -------------------------------------------------------------------------------------------------
def test_share_prefixes_groups_rows_by_their_common_leading_blocks():
    tables = np.array([[5, 6, 7, 9], [5, 6, 7, 10], [5, 6, 8, 11], [3, 4, 12, 0], [3, 4, 13, 0], [2, 14, 0, 0]],
                      np.int32)
    kv_lens = np.array([60, 50, 40, 35, 40, 20])   # newest tokens in blocks 3, 3, 2, 2, 2, 1 (block size 16)
    groups = share_prefixes(tables, kv_lens, 16, max_groups=8)
    assert [(list(rows), shared) for rows, shared in groups] == [([0, 1, 2], 32), ([3, 4], 32)]
    # [5, 6] saves 32 x 2 reads, [3, 4] 32 x 1: max_groups keeps the larger
    assert [list(r) for r, _ in share_prefixes(tables, kv_lens, 16, max_groups=1)] == [[0, 1, 2]]
    # a newest token's block is never shared: row 3's newest token is in block 3, the only one it shares
    assert share_prefixes(tables[3:5], np.array([16, 30]), 16, max_groups=8) == []


def test_cascade_rule_by_mode_and_kernels(monkeypatch):
    pallas, reference = AttentionKernels("pallas"), AttentionKernels("reference")
    assert cascade_rule("auto", pallas, None) == (CASCADE_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS)   # off Hopper: Triton's
    assert cascade_rule("auto", reference, None) is None   # the CPU: nothing to save by default
    assert cascade_rule("on", reference, None) == (2, 1)
    assert cascade_rule("off", pallas, None) is None
    assert cascade_rule("auto", pallas, 4096) is None and cascade_rule("auto", AttentionKernels("cuda"), None) is None
    with pytest.raises(ValueError, match="cascade_attention='on' cannot run with a sliding window"):
        cascade_rule("on", pallas, 4096)
    with pytest.raises(ValueError, match="vattention's contiguous kernels"):
        cascade_rule("on", AttentionKernels("pallas", blocks_per_row=8), None)
    mosaic = AttentionKernels("pallas", decode_backend="mosaic")
    assert cascade_rule("auto", mosaic, None) == (CASCADE_MOSAIC_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS)
    assert cascade_rule("on", mosaic, None) == (2, 1)
    kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")
    monkeypatch.setattr(kernels, "gpu_capability", lambda: 9.0)   # on Hopper "auto" cascades on Mosaic GPU's kernel
    assert cascade_rule("auto", pallas, None) == (CASCADE_MOSAIC_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS)
    triton = AttentionKernels("pallas", decode_backend="triton")
    assert cascade_rule("auto", triton, None) == (CASCADE_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS)



def test_without_triton_cascades_run_mosaics_kernels_or_the_reference(monkeypatch):
    """Under a JAX without Triton's backend: the rule's thresholds are the Mosaic kernel's ("auto" runs it on
    Hopper); interpreted here (no Hopper) a cascade batch runs the reference, as exact as it; "triton" by name is
    refused."""
    without_triton(monkeypatch)
    rule = cascade_rule("auto", AttentionKernels("pallas"), None)
    assert rule == (CASCADE_MOSAIC_MIN_MEMBERS, CASCADE_MIN_SAVED_KEYS)
    batch, cascade, _ = make_cascade_batch(np.random.default_rng(3), *LAYOUTS["several"], **GEOMETRY)
    out = np.asarray(run(batch, cascade, impl="pallas", interpret=True))
    expected = np.asarray(run(batch, cascade, impl="reference"))
    assert not np.isnan(out[:batch.live_tokens]).any()
    np.testing.assert_array_equal(out[:batch.live_tokens], expected[:batch.live_tokens])
    with pytest.raises(ValueError, match="decode_backend='triton' but this JAX ships no Pallas Triton backend"):
        run(batch, cascade, impl="pallas", interpret=True, decode_backend="triton")

def test_the_rule_keeps_large_groups_that_save_enough():
    rule = cascade_rule("auto", AttentionKernels("pallas"), None)
    system, samples = (np.arange(256), 1024), [(np.arange(8 * i, 8 * i + 8), 1024) for i in range(32)]
    assert apply_cascade_rule([system], rule) == [system]
    assert apply_cascade_rule(samples, rule) == []   # n = 8: plain decode reads each prefix from L2 after one read
    assert apply_cascade_rule([*samples[:3], system], rule) == [system]
    assert apply_cascade_rule([(np.arange(256), 16)], rule) == []   # 16 x 255 key reads saved: too few
    assert apply_cascade_rule(samples, cascade_rule("on", AttentionKernels("pallas"), None)) == samples


def test_over_mosaic_the_rule_keeps_groups_of_eight_that_save_enough():
    """Over the Mosaic GPU kernel n = 8 pays (measured); one group of 64 or of 8 members behind 1,024 tokens does
    not, nor do pairs."""
    rule = cascade_rule("auto", AttentionKernels("pallas", decode_backend="mosaic"), None)
    samples = [(np.arange(8 * i, 8 * i + 8), 1024) for i in range(32)]
    assert apply_cascade_rule(samples, rule) == samples
    assert apply_cascade_rule([(np.arange(64), 1024)], rule) == []
    assert apply_cascade_rule([(np.arange(8), 1024)], rule) == []
    assert apply_cascade_rule([(np.arange(2 * i, 2 * i + 2), 1024) for i in range(64)], rule) == []


@pytest.fixture(scope="module")
def tiny_cascade():
    loaded = random_model(TINY, jnp.float32)
    return {mode: LLM(loaded, **KNOBS, num_blocks=128, cascade_attention=mode) for mode in ("off", "on")}


@pytest.mark.slow
def test_engine_tokens_identical_with_cascade(tiny_cascade):
    """Requests behind one shared prompt (a system prompt), n = 3 and the other kinds, as a decode-only step's groups:
    token-identical to cascade off, and the cascade graphs ran."""
    system = list(range(10, 50))   # 40 tokens: two whole blocks of 16 shared
    prompts, params = mixed_requests()
    prompts += [system + [60 + i] * (i + 1) for i in range(5)]
    params += [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 4 + \
        [SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=16, ignore_eos=True)]
    outs = {mode: llm.generate(prompts, params, use_tqdm=False) for mode, llm in tiny_cascade.items()}
    assert [[c.token_ids for c in o.outputs] for o in outs["on"]] == \
        [[c.token_ids for c in o.outputs] for o in outs["off"]]
    cascades = {mode: [key for key in llm.engine.graphs.manager.executables if key.kind == "model" and key.dims[4]]
                for mode, llm in tiny_cascade.items()}
    assert cascades["on"] and not cascades["off"]
    stats = {mode: llm.engine.stats() for mode, llm in tiny_cascade.items()}
    assert stats["on"]["cascade_steps"] > 0 and stats["off"]["cascade_steps"] == 0
    assert stats["on"]["compiles_after_start"] == 0
