"""Ragged paged attention: the reference against float64 numpy, the kernel against the reference.

On CPU the kernel runs in Pallas interpret mode, on an NVIDIA GPU compiled. The KV cache is NaN everywhere
no live token was written, block-table entries past a sequence's end are garbage, and (on GPU) freed NaN
buffers poison the allocator: reading anything unwritten, or leaving an output row unwritten, shows up
as NaN. Padding rows must come out exactly zero.

FP8 caches (float8_e4m3fn, NaN where unwritten too) are checked against the reference over the same cache: e4m3
values are exact in q's dtype and the reference reads the same ones, so q's dtype sets every tolerance.
"""
import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

from helpers import (GEOMETRY, MIXES, Batch, cached_as, check_close, interpret_tuning, make_batch, naive_attention,
                     on_gpu, on_hopper, poison_allocator)

ON_GPU = on_gpu()
INTERPRET = not ON_GPU
INTERPRET_TUNING = interpret_tuning()
FP8 = jnp.float8_e4m3fn
KERNELS = importlib.import_module("pallas_kernels.ragged_paged_attention")  # the package exports its function's name


def check_kernel(batch: Batch, dtype, label="", tuning=None, **options):
    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
    poison_allocator(batch)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                                 **options, **(tuning or INTERPRET_TUNING))
    check_close(out, expected, batch, dtype, label)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("options, cache", [
    ({}, None),
    ({"sliding_window": 20}, None),
    ({"soft_cap": 5.0}, None),
    ({}, FP8),  # e4m3 blocks converted to float32 as they are gathered
])
def test_reference_matches_float64(mix, options, cache):
    batch = cached_as(make_batch(np.random.default_rng(0), *MIXES[mix], **GEOMETRY), cache)
    out = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
    check_close(out, naive_attention(batch, sm_scale=0.125, **options), batch, jnp.float32)


@pytest.mark.parametrize("dtype, cache, options", [
    (jnp.float32, None, {}),
    (jnp.float32, None, {"sliding_window": 20, "soft_cap": 5.0}),  # windows shorter than most contexts
    (jnp.float32, FP8, {"sliding_window": 20, "soft_cap": 5.0}),  # e4m3 tiles converted to float32
    (jnp.bfloat16, None, {}),
    (jnp.bfloat16, None, {"sliding_window": 33}),
    (jnp.bfloat16, FP8, {"sliding_window": 33}),
])
def test_kernel_matches_reference(dtype, cache, options):
    rng = np.random.default_rng(1)
    for name, (q_lens, kv_lens) in MIXES.items():
        check_kernel(cached_as(make_batch(rng, q_lens, kv_lens, **GEOMETRY, dtype=dtype), cache), dtype, name,
                     **options)


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size", [
    (2, 2, 128, 16),  # GQA ratio 1, head_dim 128
    (6, 2, 64, 8),  # ratio 3: q rows padded to a power of two
    (8, 1, 64, 32),  # ratio 8, pages larger than a kv tile
])
def test_kernel_gqa_and_shapes(q_heads, kv_heads, head_dim, block_size):
    shape = {**GEOMETRY, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
             "max_blocks": 128 // block_size}
    batch = make_batch(np.random.default_rng(3), *MIXES["mixed"], **shape, dtype=jnp.bfloat16)
    check_kernel(batch, jnp.bfloat16)


@pytest.mark.parametrize("q_heads, kv_heads", [(8, 2), (8, 1)])  # GQA 8: the merge takes two steps of 8 splits
def test_split_k_decode(q_heads, kv_heads):
    """Few decodes over long contexts: contexts split over up to 16 programs, some of them empty."""
    shape = {**GEOMETRY, "max_blocks": 16, "q_heads": q_heads, "kv_heads": kv_heads}
    tuning = {"decode_kv_tile": 16, "decode_programs": 64, "decode_max_splits": 16}
    rng = np.random.default_rng(4)
    for q_lens, kv_lens in (([1, 1, 1], [250, 7, 161]), ([1], [203])):
        check_kernel(make_batch(rng, q_lens, kv_lens, **shape), jnp.float32, str(kv_lens), tuning,
                     sliding_window=100)


@pytest.mark.parametrize("max_splits", [16, 1])
@pytest.mark.parametrize("dtype, cache, options", [
    (jnp.float32, None, {"soft_cap": 5.0}),
    (jnp.bfloat16, None, {"sliding_window": 33}),
    (jnp.bfloat16, FP8, {"sliding_window": 33}),
])
def test_one_launch_decode(dtype, cache, options, max_splits):
    """decode_only=True: one launch. Each context is split over 4 programs taking every 4th 16-key tile, the
    last of a decode to finish merging the partials (max_splits 16), or one program attends it all (1).
    Every row past the decodes (padding sequences and padding tokens, here more tokens than sequence slots)
    comes out zero."""
    shape = {**GEOMETRY, "num_tokens": 16, "max_blocks": 16}
    tuning = {"decode_programs": 64, "decode_kv_tile": 16, "decode_max_splits": max_splits}  # 4 splits
    rng = np.random.default_rng(5)
    for kv_lens in ([1, 17, 40, 64, 99, 250, 3], [203], [16] * 8):
        batch = cached_as(make_batch(rng, [1] * len(kv_lens), kv_lens, **shape, dtype=dtype), cache)
        expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
        poison_allocator(batch)
        out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                                     decode_only=True, decode_backend="triton", **options, **tuning)
        check_close(out, expected, batch, dtype, str(kv_lens))


@pytest.mark.parametrize("dtype, decode_only, q_lens, kv_lens", [
    (jnp.bfloat16, False, *MIXES["mixed"]),  # split decodes merged in the prefill launch
    (jnp.float16, True, [1] * 6, [1, 17, 40, 64, 99, 250]),
])
def test_fp8_cache_reads_as_its_values(dtype, decode_only, q_lens, kv_lens):
    """The kernels over an fp8 cache give what they give over the same e4m3 values stored in the dots' dtype (f16
    under a 16-bit q), q in that dtype, the same tuning: each tile converts exactly, then the same dots run on the
    same values. A bf16 q's output then differs by its last rounding at most (f32 -> f16 -> bf16 may round twice).
    Both take the Triton kernels ("auto" would give q's dtype the Mosaic ones on Hopper: other dots, other
    roundings)."""
    shape = {**GEOMETRY, "num_tokens": 16, "max_blocks": 16} if decode_only else GEOMETRY
    fp8 = cached_as(make_batch(np.random.default_rng(12), q_lens, kv_lens, **shape, dtype=dtype), FP8)
    compute = KERNELS.dot_dtype(dtype, FP8)
    tuning = dataclasses.asdict(KERNELS.make_tuning(dtype, INTERPRET_TUNING, FP8))
    outs = []
    for batch in (fp8, dataclasses.replace(cached_as(fp8, compute), q=fp8.q.astype(compute))):
        poison_allocator(batch)
        outs.append(ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                                           decode_only=decode_only, prefill_backend="triton",
                                           decode_backend="triton", **tuning))
    # finite live rows and zero padding first (equality alone passes NaN == NaN)
    check_close(outs[0], ragged_paged_attention_reference(*fp8.args(), sm_scale=0.125), fp8, jnp.bfloat16)
    got, same = (np.asarray(o.astype(dtype).astype(jnp.float32)) for o in outs)
    np.testing.assert_allclose(got, same, rtol=0 if compute == dtype else 2.0 ** -7, atol=0)


def test_fp8_cache_clips_q_to_float16():
    """A bf16 q beyond float16's range (65504) over an fp8 cache runs its dots in f16 clipped, not as inf (inf - inf
    in the softmax would be NaN)."""
    batch = cached_as(make_batch(np.random.default_rng(14), *MIXES["mixed"], **GEOMETRY, dtype=jnp.bfloat16), FP8)
    batch = dataclasses.replace(batch, q=batch.q * 1e6)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                                 prefill_backend="triton", **INTERPRET_TUNING)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()


def test_fp8_cache_below_sm89(monkeypatch):
    """Triton converts e4m3 on sm_89+ only: on an sm_80 GPU "auto" takes the reference over an fp8 cache, and
    "pallas" refuses, naming the way out."""
    monkeypatch.setattr(KERNELS, "gpu_capability", lambda: 8.0)
    batch = cached_as(make_batch(np.random.default_rng(13), *MIXES["mixed"], **GEOMETRY, dtype=jnp.bfloat16), FP8)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125)
    check_close(out, ragged_paged_attention_reference(*batch.args(), sm_scale=0.125), batch, jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='pallas' reads a float8_e4m3fn cache.*impl='reference'"):
        ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas")


def test_random_mixes():
    """Random ragged mixes: q lengths 1..chunk, decodes first, random contexts."""
    rng = np.random.default_rng(6)
    for i in range(6):
        q_lens = [1] * int(rng.integers(0, 4)) + [int(n) for n in rng.integers(2, 17, rng.integers(0, 3))]
        q_lens = q_lens or [int(rng.integers(1, 33))]
        kv_lens = [q + int(rng.integers(0, 128 - q)) for q in q_lens]
        batch = make_batch(rng, q_lens, kv_lens, **GEOMETRY, dtype=jnp.bfloat16)
        check_kernel(batch, jnp.bfloat16, f"mix {i}: {q_lens} {kv_lens}", sliding_window=33)


def test_auto_picks_a_correct_impl():
    """impl='auto' runs the kernel on a GPU and the reference elsewhere; either way it matches."""
    batch = make_batch(np.random.default_rng(7), *MIXES["mixed"], **GEOMETRY)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125)
    check_close(out, ragged_paged_attention_reference(*batch.args(), sm_scale=0.125), batch, jnp.float32)


@pytest.mark.parametrize("change, field", [
    ({"q": jnp.zeros((4, 64))}, "q"),
    ({"v_cache": jnp.zeros((5, 16, 2, 64))}, "v_cache"),
    ({"q": jnp.zeros((64, 3, 64))}, "num_q_heads"),
    ({"k_cache": jnp.zeros((48, 16, 2, 64), jnp.bfloat16)}, "k_cache and v_cache"),  # float32 q: no other dtype
    ({"k_cache": jnp.zeros((48, 16, 2, 64), FP8)}, "k_cache and v_cache"),  # V float32: both or neither fp8
    ({"q": jnp.zeros((64, 8, 64), jnp.int8), "k_cache": jnp.zeros((48, 16, 2, 64), FP8),
      "v_cache": jnp.zeros((48, 16, 2, 64), FP8)}, "k_cache and v_cache"),  # fp8 needs a float q the kernels take
    ({"kv_lens": jnp.zeros((3,), jnp.int32)}, "cu_q_lens"),
    ({"block_tables": jnp.zeros((8, 4), jnp.float32)}, "block_tables"),
    ({"num_seqs": jnp.zeros((2,), jnp.int32)}, "num_seqs"),
    ({"sm_scale": -1.0}, "sm_scale"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"soft_cap": 0.0}, "soft_cap"),
    ({"impl": "triton"}, "impl"),
    ({"prefill_backend": "cuda"}, "prefill_backend"),
    ({"decode_kv_tile": 24}, "decode_kv_tile"),
    ({"bogus_knob": 1}, "bogus_knob"),
])
def test_rejects_bad_input(change, field):
    batch = make_batch(np.random.default_rng(8), *MIXES["mixed"], **GEOMETRY)
    args = dict(zip(["q", "k_cache", "v_cache", "cu_q_lens", "kv_lens", "block_tables", "num_seqs"], batch.args()))
    kwargs = {"sm_scale": 0.125, "impl": "pallas", "interpret": INTERPRET}
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=field):
        ragged_paged_attention(*args.values(), **kwargs)


HOPPER = on_hopper()
# Long prompts and chunks over cached context: several 128-row tiles per sequence, partial last tiles.
MOSAIC_MIXES = {
    "mixed": ([1, 1, 1, 13, 30, 7], [33, 5, 80, 13, 71, 50]),
    "long": ([1, 70, 130, 5], [20, 100, 200, 40]),
    "one_prompt": ([190], [190]),
}


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU and not HOPPER, reason="the Mosaic GPU prefill kernel needs sm_90 (H100/H200)")
@pytest.mark.parametrize("dtype, cache, q_heads, kv_heads, head_dim, block_size, options", [
    # 4 pages per step: two per copying warp; e4m3 K and V converted to float16 tiles, logits tanh-capped
    (jnp.bfloat16, FP8, 4, 2, 64, 16, {"soft_cap": 5.0}),
    (jnp.bfloat16, None, 8, 1, 128, 16, {"sliding_window": 37}),  # GQA 8, head_dim 128, window inside the tiles
    (jnp.float16, None, 2, 2, 64, 64, {}),  # GQA 1; one page per step: one warp of each pair copies nothing
])
def test_mosaic_prefill_matches_reference(dtype, cache, q_heads, kv_heads, head_dim, block_size, options):
    """The Hopper (wgmma/TMA) prefill kernel inside the ragged entry point, decodes merged beside it."""
    shape = {**GEOMETRY, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
             "num_tokens": 256, "max_blocks": 16, "num_blocks": 64}
    rng = np.random.default_rng(10)
    for name, (q_lens, kv_lens) in MOSAIC_MIXES.items():
        batch = cached_as(make_batch(rng, q_lens, kv_lens, **shape, dtype=dtype), cache)
        check_kernel(batch, jnp.bfloat16, name, {**INTERPRET_TUNING, "prefill_backend": "mosaic",
                                                  "mosaic_block_kv": 64}, **options)


def test_mosaic_prefill_refuses_what_it_cannot_serve():
    """Asked for by name it refuses with the reason and names the Triton prefill, which "auto" takes for such
    calls."""
    batch = make_batch(np.random.default_rng(11), *MIXES["mixed"], **GEOMETRY, dtype=jnp.float32)
    with pytest.raises(ValueError, match="prefill_backend='mosaic'.*dtype float32.*prefill_backend='triton'"):
        ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=INTERPRET,
                               prefill_backend="mosaic")
