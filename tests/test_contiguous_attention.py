"""Contiguous (vAttention) attention: sequence i's KV is row kv_rows[i] of the cache, no block table.

Each batch is a paged test batch with its pages moved, in order, into the rows of `KV_ROWS` (out of order, with
gaps), NaN everywhere else; kv_rows past num_seqs are garbage. The contiguous kernel is checked against the
direct slice reference (no block ids: not circular), against the paged kernel over the kv_rows' identity table,
and the references against float64 numpy. Outputs start as NaN (the interpreter fills them so; on GPU the
allocator is poisoned): an unwritten row never passes, and padding rows must be exactly zero. FP8 caches
(float8_e4m3fn) are checked against the references over the same cache: e4m3 values are exact in q's dtype, so q's
dtype sets the tolerance.
"""
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from pallas_kernels.ragged_paged_attention import contiguous_ragged_attention, ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import (contiguous_ragged_attention_reference,
                                                              contiguous_slice_reference)

from helpers import (GEOMETRY, MIXES, Batch, cached_as, check_close, interpret_tuning, make_batch, naive_attention,
                     on_gpu, on_hopper, poison_allocator)

ON_GPU = on_gpu()
INTERPRET = not ON_GPU
INTERPRET_TUNING = interpret_tuning()

BLOCKS_PER_ROW = 8  # rows of 128 tokens at block_size 16: GEOMETRY's longest context fills one
KV_ROWS = [5, 1, 3, 0, 4, 2]  # cache rows of sequences 0, 1, ...: out of order, the first three with gaps
NUM_ROWS = 6
FP8 = jnp.float8_e4m3fn


@dataclass(slots=True)
class RowBatch:
    paged: Batch  # the same batch as the paged kernel sees it: the kv_rows' identity block table
    kv_rows: jax.Array
    blocks_per_row: int

    def args(self):
        b = self.paged
        return b.q, b.k_cache, b.v_cache, b.cu_q_lens, b.kv_lens, self.kv_rows, b.num_seqs


def to_rows(rng, batch: Batch, blocks_per_row=BLOCKS_PER_ROW, num_rows=NUM_ROWS) -> RowBatch:
    """`batch` on a contiguous cache: sequence i's pages, in order, at the start of row KV_ROWS[i]; NaN elsewhere."""
    num_seqs, max_seqs = int(batch.num_seqs[0]), batch.block_tables.shape[0]
    kv_rows = rng.integers(-5, 1 << 20, max_seqs).astype(np.int32)  # garbage past num_seqs
    kv_rows[:num_seqs] = KV_ROWS[:num_seqs]
    tables = np.asarray(batch.block_tables).copy()
    identity = kv_rows[:num_seqs, None] * blocks_per_row + np.arange(blocks_per_row)
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        paged, contiguous = np.asarray(cache), np.full((num_rows * blocks_per_row, *cache.shape[1:]), np.nan,
                                                       np.asarray(cache).dtype)
        for i, kv_len in enumerate(np.asarray(batch.kv_lens)[:num_seqs]):
            pages = -(-int(kv_len) // cache.shape[1])
            contiguous[identity[i, :pages]] = paged[tables[i, :pages]]
        caches.append(jnp.asarray(contiguous))
    tables = np.concatenate([identity, rng.integers(-5, 1 << 20, (max_seqs - num_seqs, blocks_per_row))])
    paged = dataclasses.replace(batch, k_cache=caches[0], v_cache=caches[1],
                                block_tables=jnp.asarray(tables, jnp.int32))
    return RowBatch(paged, jnp.asarray(kv_rows), blocks_per_row)


def row_batch(rng, q_lens, kv_lens, dtype=jnp.float32, cache=None, **shape) -> RowBatch:
    """A contiguous test batch with q in `dtype` and K/V stored as `cache` (None: dtype too)."""
    return to_rows(rng, cached_as(make_batch(rng, q_lens, kv_lens, **{**GEOMETRY, **shape}, dtype=dtype), cache))


def check_contiguous_kernel(batch: RowBatch, dtype, label="", tuning=None, **options):
    """The contiguous kernel against the slice reference, and the paged kernel over the identity table.
    tuning: the kernels' own options (Tuning fields, decode_only, prefill_backend); options: the scores'."""
    tuning = INTERPRET_TUNING if tuning is None else tuning
    expected = contiguous_slice_reference(*batch.args(), blocks_per_row=batch.blocks_per_row, sm_scale=0.125,
                                          **options)
    poison_allocator(batch.paged)
    out = contiguous_ragged_attention(*batch.args(), blocks_per_row=batch.blocks_per_row, sm_scale=0.125,
                                      impl="pallas", interpret=INTERPRET, **options, **tuning)
    check_close(out, expected, batch.paged, dtype, f"{label} vs slice reference")
    poison_allocator(batch.paged)
    paged = ragged_paged_attention(*batch.paged.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                                   **options, **tuning)
    check_close(out, paged.astype(jnp.float32), batch.paged, dtype, f"{label} vs paged kernel")


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("options, cache", [
    ({}, None),
    ({"sliding_window": 20}, None),
    ({"soft_cap": 5.0}, None),
    ({}, FP8),  # e4m3 blocks converted to float32 as they are gathered
])
def test_references_match_float64(mix, options, cache):
    """Both contiguous references (slice; paged over the identity table) against numpy on the identity table."""
    batch = row_batch(np.random.default_rng(0), *MIXES[mix], cache=cache)
    expected = naive_attention(batch.paged, sm_scale=0.125, **options)
    for reference in (contiguous_slice_reference, contiguous_ragged_attention_reference):
        out = reference(*batch.args(), blocks_per_row=BLOCKS_PER_ROW, sm_scale=0.125, **options)
        check_close(out, expected, batch.paged, jnp.float32, reference.__name__)


@pytest.mark.parametrize("dtype, cache, options", [   # soft cap in the quick loop: test_one_launch_decode
    pytest.param(jnp.float32, None, {"sliding_window": 20, "soft_cap": 5.0}, marks=pytest.mark.slow),
    (jnp.bfloat16, None, {}),
    (jnp.bfloat16, None, {"sliding_window": 33}),
    (jnp.bfloat16, FP8, {"sliding_window": 33}),
])
def test_kernel_mixed_batches(dtype, cache, options):
    """Decodes, prefills and mixes (contexts across block boundaries), split-K decodes merged in the prefill."""
    rng = np.random.default_rng(1)
    for name, (q_lens, kv_lens) in MIXES.items():
        check_contiguous_kernel(row_batch(rng, q_lens, kv_lens, dtype, cache), dtype, name, **options)


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size", [
    (2, 2, 128, 16),  # GQA ratio 1, head_dim 128
    pytest.param(6, 2, 64, 8, marks=pytest.mark.slow),  # ratio 3: q rows padded to a power of two
    pytest.param(8, 1, 64, 32, marks=pytest.mark.slow),  # ratio 8, blocks larger than a kv tile
])
def test_kernel_gqa_and_shapes(q_heads, kv_heads, head_dim, block_size):
    shape = {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
             "max_blocks": 128 // block_size}
    rng = np.random.default_rng(3)
    batch = to_rows(rng, make_batch(rng, *MIXES["mixed"], **{**GEOMETRY, **shape}, dtype=jnp.bfloat16),
                     blocks_per_row=128 // block_size)
    check_contiguous_kernel(batch, jnp.bfloat16)


@pytest.mark.parametrize("max_splits", [16, 1])
@pytest.mark.parametrize("dtype, cache, options, backend", [
    (jnp.float32, None, {"soft_cap": 5.0}, "triton"),
    (jnp.bfloat16, None, {"sliding_window": 33}, "triton"),
    (jnp.bfloat16, FP8, {"sliding_window": 33}, "triton"),
    *(pytest.param(jnp.bfloat16, cache, {"sliding_window": 33}, "mosaic",
                   marks=pytest.mark.skipif(ON_GPU and not on_hopper(), reason="Mosaic GPU decode needs sm_90"))
      for cache in (None, FP8)),
])
def test_one_launch_decode(dtype, cache, options, backend, max_splits):
    """decode_only=True: 4 programs (Triton) or work items (Mosaic) per context, or 1; Triton's first tile's loads
    speculative (garbage kv_rows past num_seqs clamped); a full row (128), block multiples and one-past; rows past
    the decodes zero."""
    shape = {"num_tokens": 16, "max_blocks": 16}
    tuning = {"decode_programs": 64, "decode_kv_tile": 16, "decode_max_splits": max_splits,
              "mosaic_decode_programs": 64, "decode_backend": backend}
    rng = np.random.default_rng(5)
    for kv_lens in ([1, 17, 128, 64, 99, 3], [16, 32, 33, 48, 112, 127]):
        batch = row_batch(rng, [1] * len(kv_lens), kv_lens, dtype, cache, **shape)
        check_contiguous_kernel(batch, dtype, str(kv_lens), {**tuning, "decode_only": True}, **options)


def test_auto_and_reference_impls():
    """impl='reference' (and 'auto' off GPU) takes the paged reference over the identity table."""
    batch = row_batch(np.random.default_rng(7), *MIXES["mixed"])
    expected = contiguous_slice_reference(*batch.args(), blocks_per_row=BLOCKS_PER_ROW, sm_scale=0.125)
    for impl in ("reference", "auto"):
        out = contiguous_ragged_attention(*batch.args(), blocks_per_row=BLOCKS_PER_ROW, sm_scale=0.125, impl=impl)
        check_close(out, expected, batch.paged, jnp.float32, impl)


def kernel_int_operands(fn, *args, **kwargs) -> list[tuple[int, ...]]:
    """Shapes of the int32 operands of every Pallas kernel that `fn` launches."""
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes.extend(v.aval.shape for v in eqn.invars if v.aval.dtype == jnp.int32)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr)
    return shapes


@pytest.mark.parametrize("decode_only", [False, True])
def test_kernels_take_no_block_table(decode_only):
    """The contiguous launches' int32 operands are num_seqs, cu_q_lens, kv_lens, kv_rows (and the decode-only
    done-counters): nothing [max_seqs, blocks_per_row], flat or not. The paged launches, over the same
    batch, do take their table: the check can see one."""
    blocks_per_row = 6  # table size 8 x 6 = 48 matches no other operand's
    batch = to_rows(np.random.default_rng(9), make_batch(np.random.default_rng(9), [1, 1, 1], [5, 40, 96],
                                                           **{**GEOMETRY, "max_blocks": 6}),
                     blocks_per_row=blocks_per_row, num_rows=7)
    options = {"sm_scale": 0.125, "impl": "pallas", "interpret": INTERPRET, "decode_only": decode_only,
               **INTERPRET_TUNING}
    table_sizes = {GEOMETRY["max_seqs"] * blocks_per_row}
    contiguous = kernel_int_operands(contiguous_ragged_attention, *batch.args(), blocks_per_row=blocks_per_row,
                                     **options)
    paged = kernel_int_operands(ragged_paged_attention, *batch.paged.args(), **options)
    assert contiguous and all(len(s) == 1 and s[0] not in table_sizes for s in contiguous), contiguous
    assert (GEOMETRY["max_seqs"],) in contiguous  # the kv_rows
    assert any(int(np.prod(s)) in table_sizes for s in paged), paged


@pytest.mark.parametrize("change, field", [
    ({"kv_rows": jnp.zeros((8, 8), jnp.int32)}, "kv_rows"),
    ({"kv_rows": jnp.zeros((8,), jnp.float32)}, "kv_rows"),
    ({"blocks_per_row": 5}, "blocks_per_row"),  # 48 blocks are not whole rows of 5
    ({"blocks_per_row": 0}, "blocks_per_row"),
])
def test_rejects_bad_input(change, field):
    batch = row_batch(np.random.default_rng(8), *MIXES["mixed"])
    args = dict(zip(["q", "k_cache", "v_cache", "cu_q_lens", "kv_lens", "kv_rows", "num_seqs"], batch.args()))
    kwargs = {"blocks_per_row": BLOCKS_PER_ROW, "sm_scale": 0.125, "impl": "pallas", "interpret": INTERPRET}
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=field):
        contiguous_ragged_attention(*args.values(), **kwargs)


HOPPER = on_hopper()


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU and not HOPPER, reason="the Mosaic GPU prefill kernel needs sm_90 (H100/H200)")
def test_mosaic_prefill():
    """The Hopper prefill kernel on kv_rows: page ids computed from the row, decodes merged beside it."""
    shape = {"q_heads": 4, "kv_heads": 2, "num_tokens": 256, "max_blocks": 16}
    tuning = {**INTERPRET_TUNING, "prefill_backend": "mosaic", "mosaic_block_kv": 64}
    rng = np.random.default_rng(10)
    for q_lens, kv_lens in (([1, 1, 70, 130], [33, 200, 100, 250]),):
        batch = to_rows(rng, make_batch(rng, q_lens, kv_lens, **{**GEOMETRY, **shape, "num_blocks": 80},
                                         dtype=jnp.bfloat16), blocks_per_row=16, num_rows=NUM_ROWS)
        check_contiguous_kernel(batch, jnp.bfloat16, str(kv_lens), tuning)
        check_cross_layer(rng, batch, jnp.bfloat16, tuning)


def to_cross_layer(rng, batch: RowBatch, num_layers: int, layer: int) -> RowBatch:
    """`batch` at `layer` of a cross-layer cache (vattention's megacache: [blocks, layers, block_size, ...]) of
    num_layers, viewed as the kernels take it ([blocks * layers, block_size, ...]); other layers are random data, and
    NaN where the batch's layer is: a kernel that reads another layer's block, or misses its own, fails."""
    caches = []
    for cache in (batch.paged.k_cache, batch.paged.v_cache):
        cache = np.asarray(cache.astype(jnp.float32))
        cross = rng.standard_normal((cache.shape[0], num_layers, *cache.shape[1:])).astype(np.float32)
        cross[:, layer] = cache
        caches.append(jnp.asarray(cross.reshape(-1, *cache.shape[1:]), batch.paged.k_cache.dtype))
    return dataclasses.replace(batch, paged=dataclasses.replace(batch.paged, k_cache=caches[0], v_cache=caches[1]))


@pytest.mark.parametrize("decode_only, cache", [
    (False, None),
    (True, None),
    (True, FP8),  # what decode steps run over an fp8 cross-layer cache
])
def test_cross_layer_cache(decode_only, cache):
    """The kernels and both references read `layer` of a cross-layer cache (the layer traced, as the engine's
    layers share one trace) and give what they give on that layer alone."""
    rng, dtype = np.random.default_rng(11), jnp.bfloat16
    kv_lens = [1, 17, 128, 64, 99, 3] if decode_only else MIXES["mixed"][1]
    q_lens = [1] * len(kv_lens) if decode_only else MIXES["mixed"][0]
    shape = {"num_tokens": 16, "max_blocks": 16} if decode_only else {}
    tuning = {**INTERPRET_TUNING, "decode_only": True, "decode_programs": 64} if decode_only else INTERPRET_TUNING
    check_cross_layer(rng, row_batch(rng, q_lens, kv_lens, dtype, cache, **shape), dtype, tuning)


def check_cross_layer(rng, single: RowBatch, dtype, tuning, num_layers=3, layer=1):
    """The references and the kernel (`tuning`) at `layer` of `single` moved into a cross-layer cache, against the
    slice reference on `single`."""
    expected = contiguous_slice_reference(*single.args(), blocks_per_row=single.blocks_per_row, sm_scale=0.125)
    batch = to_cross_layer(rng, single, num_layers, layer)
    options = {"blocks_per_row": batch.blocks_per_row, "sm_scale": 0.125, "num_layers": num_layers}

    def at_layer(fn, **kw):
        return jax.jit(lambda layer, *args: fn(*args, layer=layer, **options, **kw))(jnp.int32(layer), *batch.args())

    for name, fn, kw in (("slice reference", contiguous_slice_reference, {}),
                         ("paged reference", contiguous_ragged_attention_reference, {}),
                         ("kernel", contiguous_ragged_attention, {"impl": "pallas", "interpret": INTERPRET,
                                                                  **tuning})):
        poison_allocator(batch.paged)
        check_close(at_layer(fn, **kw).astype(jnp.float32), expected.astype(jnp.float32), batch.paged, dtype, name)


def test_cross_layer_rejects_bad_layer():
    batch = row_batch(np.random.default_rng(12), *MIXES["mixed"])
    for change, field in (({"num_layers": 0}, "num_layers"), ({"num_layers": 2, "layer": 2}, "layer")):
        with pytest.raises(ValueError, match=field):
            contiguous_ragged_attention(*batch.args(), blocks_per_row=BLOCKS_PER_ROW, sm_scale=0.125, **change)
