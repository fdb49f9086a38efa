"""custom_calls: CUDA FFI ops against their pure-JAX references (GPU), and on CPU the nvcc build,
the exported FFI symbols, registration + lowering for platform CUDA, the references against
naive loops, argument checks and the fallback with its notice; caches in q's dtype and FP8 (e4m3).

GPU tests skip on CPU; on a GPU run `JAX_PLATFORMS=cuda pytest tests/test_custom_calls.py` (conftest
defaults JAX_PLATFORMS to cpu)."""
import ctypes
import functools
import logging
import math
import re
import struct
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls import build, vmm

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU; CPU CI covers build/registration/fallback")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
FP8 = jnp.float8_e4m3fn
CACHE_DTYPES = [pytest.param(None, id="cache=q"), pytest.param(FP8, id="cache=fp8")]   # None: q's dtype
SYMBOLS = ("JaxservePagedDecodeAttention", "JaxserveReshapeAndCache", "JaxserveCopyBlocks", "JaxserveDecodeLinear",
           "JaxserveMoeRoute", "JaxserveFp8QuantizeRows", "JaxserveFp8ScaledMm", "JaxserveFp8Mm",
           "JaxserveCopyOutsideGraphs", "JaxserveHasCublasLt")


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return seed, np.random.default_rng(seed)


def assert_same_bits(out, ref, seed):
    """Bit-exact equality, NaN poison included (numpy's NaN-aware compare misses bfloat16)."""
    out, ref = np.asarray(out), np.asarray(ref)
    bits = f"u{out.dtype.itemsize}"
    assert out.dtype == ref.dtype and np.array_equal(out.view(bits), ref.view(bits)), f"seed {seed}"


def random_values(rng, shape, dtype) -> np.ndarray:
    """Finite values in dtype; for float8_e4m3fn every finite bit pattern (subnormals, -0 too) is drawn."""
    if jnp.dtype(dtype) == FP8:
        bits = rng.integers(0, 256, shape, dtype=np.uint8)
        return np.where((bits & 0x7F) == 0x7F, bits ^ 1, bits).view(jnp.dtype(FP8))  # 0x7F, 0xFF are NaN
    return rng.standard_normal(shape).astype(jnp.dtype(dtype))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "output holds NaN/Inf"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_paged_case(rng, *, lens, q_heads, kv_heads, head_dim, block_size=16, max_blocks=None, dtype=jnp.float32,
                    cache_dtype=None):
    """Random q in dtype and live cache slots in cache_dtype (default dtype; t < len - 1: the step writes the
    token at len - 1), pages in random order, every other slot (null block 0, slot tails, spare blocks)
    NaN-poisoned."""
    lens = np.asarray(lens, np.int32)
    need = [math.ceil(n / block_size) for n in lens]
    max_blocks = max_blocks or max(max(need), 1)
    num_blocks = 1 + sum(need) + 3
    pages = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(lens), max_blocks), np.int32)
    k_cache = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan, np.float32)
    v_cache = k_cache.copy()
    used = 0
    for b, n in enumerate(lens):
        tables[b, :need[b]] = pages[used:used + need[b]]
        used += need[b]
        for t in range(max(n - 1, 0)):
            k_cache[tables[b, t // block_size], t % block_size] = rng.standard_normal((kv_heads, head_dim))
            v_cache[tables[b, t // block_size], t % block_size] = rng.standard_normal((kv_heads, head_dim))
    slots = np.where(lens > 0, tables[np.arange(len(lens)), np.maximum(lens - 1, 0) // block_size] * block_size
                     + np.maximum(lens - 1, 0) % block_size, 0).astype(np.int32)  # padding rows write the null block
    cast = lambda a: jnp.asarray(a, cache_dtype or dtype)
    new_shape = (len(lens), kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((len(lens), q_heads, head_dim)), dtype)
    return dict(q=q, k_cache=cast(k_cache), v_cache=cast(v_cache), new_k=cast(rng.standard_normal(new_shape)),
                new_v=cast(rng.standard_normal(new_shape)),
                slots=jnp.asarray(slots), kv_lens=jnp.asarray(lens), block_tables=jnp.asarray(tables))


def naive_decode(q, k_cache, v_cache, kv_lens, block_tables, sm_scale, window, cap):
    """Per-sequence, per-head float64 loop: the oracle for the JAX reference. (out, log2 of each softmax's
    denominator: -inf for a row with no keys)."""
    q, k_cache, v_cache = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    q_heads, (block_size, kv_heads) = q.shape[1], k_cache.shape[1:3]
    out, lse = np.zeros_like(q), np.full(q.shape[:2], -np.inf)
    for b, n in enumerate(np.asarray(kv_lens)):
        pos = np.arange(n)
        pos = pos[pos > n - 1 - window] if window else pos
        if not len(pos):
            continue
        rows = [(block_tables[b, t // block_size], t % block_size) for t in pos]
        keys = np.stack([k_cache[blk, off] for blk, off in rows])
        values = np.stack([v_cache[blk, off] for blk, off in rows])
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            s = keys[:, kvh] @ q[b, h] * sm_scale
            s = cap * np.tanh(s / cap) if cap else s
            p = np.exp(s - s.max())
            out[b, h] = p @ values[:, kvh] / p.sum()
            lse[b, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return out, lse


def decode_kwargs(head_dim, window, cap):
    return dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap)


# ---------------------------------------------------------------- CPU: references vs naive loops

@pytest.mark.parametrize("dtype,cache_dtype,tolerance", [
    (jnp.float32, None, 1e-5), (jnp.float32, FP8, 1e-5),
    (jnp.bfloat16, FP8, 2 ** -8)])  # bf16 output: its rounding (half an ulp, 2^-9 relative) dominates
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window,cap", [
    (4, 4, 64, None, None), (8, 2, 128, None, 30.0), (8, 1, 64, 20, None), (16, 2, 64, 7, 5.0)])
def test_decode_reference_matches_naive_loop(dtype, cache_dtype, tolerance, q_heads, kv_heads, head_dim, window, cap):
    """Against a float64 loop over the cache dequantized to float32 (exact for e4m3)."""
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[37, 0, 16, 61, 1], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                           max_blocks=5, dtype=dtype, cache_dtype=cache_dtype)
    k_cache, v_cache = cc.reshape_and_cache_reference(case["k_cache"], case["v_cache"], case["new_k"],
                                                      case["new_v"], case["slots"])
    kw = decode_kwargs(head_dim, window, cap)
    out = cc.paged_decode_attention_reference(case["q"], k_cache, v_cache, case["kv_lens"], case["block_tables"], **kw)
    assert out.dtype == dtype
    ref, _ = naive_decode(case["q"], k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), case["kv_lens"],
                          np.asarray(case["block_tables"]), kw["sm_scale"], window, cap)
    assert rel_err(out, ref) <= tolerance, f"seed {seed}"
    assert not np.asarray(out[1]).any(), "padding row (kv_len 0) must be zeros"


@pytest.mark.parametrize("cache_dtype", [None, FP8])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window,cap", [(8, 2, 128, None, 30.0), (16, 2, 64, 7, None)])
def test_decode_partials_reference_gives_each_row_its_attention_and_log2_sum_exp(cache_dtype, q_heads, kv_heads,
                                                                                  head_dim, window, cap):
    """One split a row, in float32: the attention and log2 of its softmax's denominator (the scores in natural
    units), against the float64 loop; a row with no keys gets zeros and -inf."""
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[37, 0, 16, 61, 1], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                           max_blocks=5, cache_dtype=cache_dtype)
    k_cache, v_cache = cc.reshape_and_cache_reference(case["k_cache"], case["v_cache"], case["new_k"],
                                                      case["new_v"], case["slots"])
    kw = decode_kwargs(head_dim, window, cap)
    out, lse = cc.paged_decode_partials(case["q"], k_cache, v_cache, case["kv_lens"], case["block_tables"], **kw)
    assert out.shape == (5, 1, q_heads, head_dim) and lse.shape == (5, 1, q_heads) and out.dtype == jnp.float32
    ref, ref_lse = naive_decode(case["q"], k_cache.astype(jnp.float32), v_cache.astype(jnp.float32),
                                case["kv_lens"], np.asarray(case["block_tables"]), kw["sm_scale"], window, cap)
    assert rel_err(out[:, 0], ref) <= 1e-5, f"seed {seed}"
    live = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse[:, 0])), live) and not np.asarray(out[1]).any(), f"seed {seed}"
    np.testing.assert_allclose(np.asarray(lse[:, 0])[live], ref_lse[live], rtol=1e-6, atol=1e-5,
                               err_msg=f"seed {seed}")   # float32 sums of up to 61 terms


def test_unpacked_partials_normalise_each_split_by_its_sum():
    """The call's workspace (each split's unnormalised sums, then its (max, sum), log2 domain) read back as
    paged_decode_partials gives them; a split with no keys (sum 0) gives zeros and -inf."""
    seed, rng = fresh_rng()
    batch, heads, splits, head_dim = 3, 4, 2, 8
    acc = rng.standard_normal((batch, heads, splits, head_dim)).astype(np.float32)
    top = rng.standard_normal((batch, heads, splits)).astype(np.float32)
    total = rng.uniform(0.5, 3.0, (batch, heads, splits)).astype(np.float32)
    total[1, 2, 0] = 0.0
    workspace = jnp.asarray(np.concatenate([acc.ravel(), np.stack([top, total], -1).ravel()]))
    out, lse = cc.unpack_partials(workspace, batch, heads, splits, head_dim)
    assert out.shape == (batch, splits, heads, head_dim) and lse.shape == (batch, splits, heads)
    live = total > 0
    expected = np.where(live[..., None], acc / np.where(live, total, 1)[..., None], 0).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(out, expected, rtol=1e-6, err_msg=f"seed {seed}")
    expected_lse = np.where(live, top + np.log2(np.where(live, total, 1)), -np.inf).transpose(0, 2, 1)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, FP8])
@pytest.mark.parametrize("write,copy", [(cc.reshape_and_cache_reference, cc.copy_blocks_reference),
                                        (cc.reshape_and_cache, cc.copy_blocks)], ids=["reference", "public"])
def test_cache_write_and_copy_match_naive_loops(dtype, write, copy):
    """Exactly the given bits land (the public ops: their checks, then the reference, or the kernels on a GPU);
    the slots and blocks written are NaN-poisoned first, so a missed write fails the bit compare."""
    seed, rng = fresh_rng()
    shape = (9, 4, 2, 64)
    k_cache, v_cache = random_values(rng, shape, dtype), random_values(rng, shape, dtype)
    slots = rng.choice(9 * 4, size=6, replace=False).astype(np.int32)
    slots[2] = -1  # padding token: dropped
    for cache in (k_cache, v_cache):
        cache.reshape(9 * 4, 2, 64)[slots[slots >= 0]] = np.nan
    k, v = random_values(rng, (6, 2, 64), dtype), random_values(rng, (6, 2, 64), dtype)
    k_out, v_out = write(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // 4, slot % 4], want_v[slot // 4, slot % 4] = k[t], v[t]
    assert_same_bits(k_out, want_k, seed)
    assert_same_bits(v_out, want_v, seed)

    k_cache, v_cache = random_values(rng, shape, dtype), random_values(rng, shape, dtype)
    src, dst = np.array([1, 2, 3, 50], np.int32), np.array([6, 7, 8, 4], np.int32)  # last pair out of range
    k_cache[dst[:3]], v_cache[dst[:3]] = np.nan, np.nan
    k_out, v_out = copy(*map(jnp.asarray, (k_cache, v_cache, src, dst)))
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want_k[dst[:3]], want_v[dst[:3]] = k_cache[src[:3]], v_cache[src[:3]]
    assert_same_bits(k_out, want_k, seed)
    assert_same_bits(v_out, want_v, seed)


def rope_case(rng, *, tokens=6, q_heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16, cache_dtype=None,
              norms=False):
    """A fused q/k/v projection's rows, positions up to 32K, distinct slots of a NaN-poisoned cache (token 2 a
    padding token, slot -1), a Rotary (Llama's frequencies; norm weights when asked) and scales per kv head."""
    cache_dtype = cache_dtype or dtype
    shape = (8, 4, kv_heads, head_dim)
    slots = rng.choice(32, size=tokens, replace=False).astype(np.int32)
    slots[2] = -1
    k_cache, v_cache = (np.asarray(random_values(rng, shape, cache_dtype)) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache.reshape(32, kv_heads, head_dim)[slots[slots >= 0]] = np.nan
    weights = [jnp.asarray(rng.uniform(0.5, 1.5, head_dim), dtype) for _ in range(2)] if norms else [None, None]
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    return dict(k_cache=jnp.asarray(k_cache), v_cache=jnp.asarray(v_cache),
                qkv=jnp.asarray(rng.standard_normal((tokens, (q_heads + 2 * kv_heads) * head_dim)) * 4, dtype),
                positions=jnp.asarray(rng.integers(0, 32768, tokens), jnp.int32), slot_mapping=jnp.asarray(slots),
                rotary=cc.Rotary(jnp.asarray(inv_freq, jnp.float32), *weights, eps=1e-6), num_q_heads=q_heads,
                k_scale=jnp.asarray(rng.uniform(0.01, 0.1, kv_heads), jnp.float32),
                v_scale=jnp.asarray(rng.uniform(0.01, 0.1, kv_heads), jnp.float32))


def rope_f64(case):
    """rope_and_cache_reference's q, k and v [T, H, D] in f64 from the same operands (no rounding between ops)."""
    hq, (hkv, d) = case["num_q_heads"], case["k_cache"].shape[2:]
    x = np.asarray(case["qkv"], np.float64).reshape(len(case["positions"]), -1, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    rotary = case["rotary"]
    if rotary.q_norm is not None:
        q, k = ((a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + rotary.eps)) * np.asarray(w, np.float64)
                for a, w in ((q, rotary.q_norm), (k, rotary.k_norm)))
    angle = np.asarray(case["positions"], np.float64)[:, None, None] * np.asarray(rotary.inv_freq, np.float64)
    cos, sin = np.cos(angle), np.sin(angle)
    q, k = (np.concatenate([a[..., :d // 2] * cos - a[..., d // 2:] * sin,
                            a[..., d // 2:] * cos + a[..., :d // 2] * sin], axis=-1) for a in (q, k))
    return q, k, v


@pytest.mark.parametrize("dtype,cache_dtype,norms", [(jnp.bfloat16, None, False), (jnp.float16, None, True),
                                                     (jnp.bfloat16, FP8, True)], ids=["bf16", "f16-norms", "fp8"])
def test_rope_and_cache_reference_matches_f64(dtype, cache_dtype, norms):
    """q within the dtype's rounding of f64's normed, rotated q (times k_scale over an FP8 cache); the slots
    written hold k and v so (over FP8 divided by their scales and clipped, within e4m3's rounding), every other row
    keeps its bits (the written slots NaN-poisoned first, a padding token's dropped)."""
    seed, rng = fresh_rng()
    case = rope_case(rng, dtype=dtype, cache_dtype=cache_dtype, norms=norms)
    q, k_cache, v_cache = cc.rope_and_cache_reference(**case)
    want_q, want_k, want_v = rope_f64(case)
    fp8 = cache_dtype == FP8
    k_scale, v_scale = (np.asarray(case[n], np.float64) if fp8 else np.ones(2) for n in ("k_scale", "v_scale"))
    ulp = 2.0 ** -(8 if dtype == jnp.bfloat16 else 11)
    want_q = want_q * np.repeat(k_scale, 2)[None, :, None]
    # the norm's two roundings, the rotation's, and the scale's: a few ulps of the terms' magnitudes
    assert np.allclose(np.asarray(q, np.float64), want_q, rtol=4 * ulp, atol=4 * ulp * np.abs(want_q).max()), \
        f"seed {seed}"
    slots = np.asarray(case["slot_mapping"])
    for out, cache, want, scale in ((k_cache, case["k_cache"], want_k, k_scale), (v_cache, case["v_cache"], want_v,
                                                                                   v_scale)):
        rows, before = np.asarray(out).reshape(32, 2, -1), np.asarray(cache).reshape(32, 2, -1)
        kept = np.setdiff1d(np.arange(32), slots)
        assert_same_bits(rows[kept], before[kept], seed)
        got = rows[slots[slots >= 0]].astype(np.float64)
        ref = np.clip(want / scale[None, :, None], -cc.FP8_MAX, cc.FP8_MAX)[slots >= 0]
        tol = 2.0 ** -3 if fp8 else 4 * ulp   # e4m3's 3 mantissa bits
        assert np.allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max()), f"seed {seed}"


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
def test_rope_and_cache_without_the_library_runs_the_reference():
    seed, rng = fresh_rng()
    case = rope_case(rng, norms=True)
    for out, ref in zip(cc.rope_and_cache(**case), cc.rope_and_cache_reference(**case)):
        assert_same_bits(out, ref, seed)


def test_rope_and_cache_unsupported_names_what():
    cache = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    assert cc.rope_and_cache_unsupported(cache, cache, jnp.zeros((3, 8 * 64), jnp.bfloat16), 4) is None
    assert "bfloat16 or float16" in cc.rope_and_cache_unsupported(cache, cache, jnp.zeros((3, 512), jnp.float32), 4)
    assert "(Hq + 2 Hkv) D" in cc.rope_and_cache_unsupported(cache, cache, jnp.zeros((3, 7 * 64), jnp.bfloat16), 3)
    assert "D in" in cc.rope_and_cache_unsupported(*(jnp.zeros((4, 16, 2, 96), jnp.bfloat16),) * 2,
                                                   jnp.zeros((3, 8 * 96), jnp.bfloat16), 4)


def add_norm_case(rng, rows, width, dtype):
    """A residual stream x and a sublayer's output delta [rows, width], rows' magnitudes spread over 2^-6..2^8 (as
    hidden states' are), delta from 1% of x's to twice it; a norm weight away from 1."""
    scale = 2.0 ** rng.uniform(-6, 8, (rows, 1))
    x = rng.standard_normal((rows, width)) * scale
    delta = rng.standard_normal((rows, width)) * scale * rng.uniform(0.01, 2, (rows, 1))
    return jnp.asarray(x, dtype), jnp.asarray(delta, dtype), jnp.asarray(rng.uniform(0.5, 1.5, width), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_add_rms_norm_reference_matches_f64(dtype):
    """The sum within one rounding of f64's x + delta; the norm within the dtype's roundings (the normalised value,
    the weight's product) of f64's norm of that sum, scaled by the weight."""
    seed, rng = fresh_rng()
    x, delta, weight = add_norm_case(rng, 5, 576, dtype)
    normed, total = cc.add_rms_norm_reference(x, delta, weight, 1e-5)
    ulp = 2.0 ** -(8 if dtype == jnp.bfloat16 else 11)
    want = np.asarray(x, np.float64) + np.asarray(delta, np.float64)
    got = np.asarray(total, np.float64)
    # atol: float16's subnormals below 2^-14, where a rounding is absolute
    assert np.allclose(got, want, rtol=ulp, atol=2.0 ** -24), f"seed {seed}"
    want_normed = got / np.sqrt(np.mean(got * got, axis=-1, keepdims=True) + 1e-5) * np.asarray(weight, np.float64)
    assert np.allclose(np.asarray(normed, np.float64), want_normed, rtol=3 * ulp, atol=3 * ulp * 2.0 ** -6), \
        f"seed {seed}"


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
def test_add_rms_norm_without_the_library_runs_the_reference():
    seed, rng = fresh_rng()
    x, delta, weight = add_norm_case(rng, 3, 64, jnp.bfloat16)
    for out, ref in zip(cc.add_rms_norm(x, delta, weight, 1e-6), cc.add_rms_norm_reference(x, delta, weight, 1e-6)):
        assert_same_bits(out, ref, seed)


def test_add_rms_norm_unsupported_names_what():
    x, w = jnp.zeros((3, 64), jnp.bfloat16), jnp.zeros(64, jnp.bfloat16)
    assert cc.add_rms_norm_unsupported(x, x, w) is None
    assert "share one dtype" in cc.add_rms_norm_unsupported(x, x.astype(jnp.float16), w)
    assert "share one dtype" in cc.add_rms_norm_unsupported(x.astype(jnp.float32), x.astype(jnp.float32),
                                                            w.astype(jnp.float32))
    assert "multiple of 8" in cc.add_rms_norm_unsupported(x[:, :60], x[:, :60], w[:60])
    wide = jnp.zeros((1, cc.ADD_RMS_NORM_MAX_WIDTH + 8), jnp.bfloat16)
    assert "up to 8192" in cc.add_rms_norm_unsupported(wide, wide, wide[0])
    assert "[T, H]" in cc.add_rms_norm_unsupported(x, x[:2], w)


@pytest.mark.parametrize("dtype", list(vmm.DLPACK_DTYPES))
def test_vmm_dlpack_codes_match_jax_export(dtype):
    """vmm's export names each dtype by the DLPack (code, bits) that jax's own export writes, FP8 included."""
    capsule = jnp.zeros((2,), dtype).__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # DLTensor: data pointer, device (2 x int32), ndim (int32), then dtype {uint8 code, uint8 bits, uint16 lanes}
    code, bits, lanes = struct.unpack("<BBH", ctypes.string_at(get(capsule, b"dltensor") + 20, 4))
    assert (code, bits, lanes) == (*vmm.DLPACK_DTYPES[dtype], 1)


# (tokens, experts, top_k, local experts, first local expert, live tokens, renormalize, logits dtype)
MOE_ROUTE_CASES = [
    pytest.param(16, 128, 8, 128, 0, 1, True, jnp.float32, id="decode_batch1_bucket16"),
    pytest.param(5, 8, 2, 4, 4, 5, False, jnp.float32, id="second_device_of_two"),
    pytest.param(130, 64, 4, 32, 0, 130, True, jnp.bfloat16, id="past_one_launch"),
    pytest.param(600, 128, 8, 64, 64, 577, True, jnp.bfloat16, id="prefill_padded"),
    pytest.param(40, 16, 3, 16, 0, 40, True, "ties", id="equal_logits"),
]
MOE_BLOCK_M = 64


def moe_logits(rng, tokens, experts, dtype):
    """Random logits; "ties": small integers in bf16, so many logits are equal (the lower expert wins)."""
    if dtype == "ties":
        return jnp.asarray(rng.integers(-3, 3, (tokens, experts)), jnp.bfloat16)
    return jnp.asarray(rng.standard_normal((tokens, experts)), dtype)


def check_routing(route, logits, num_live, base, top_k, renormalize, local, label):
    """route against a float64 numpy routing: the top_k (equal logits: the lower expert first) and their weights (0
    for padding tokens); each routed pair's padded row in a tile of its expert whose sorted row holds its token;
    every group's rows contiguous, in group order; the tiles each group's rows span from its first row rounded down
    to 8; the rest nowhere (pair rows past the padded output, tiles and sorted rows past the plan zeros)."""
    values = np.asarray(logits, np.float64)
    tokens, experts = values.shape
    picks = np.argsort(-values, axis=1, kind="stable")[:, :top_k]
    probs = np.exp(values - values.max(axis=1, keepdims=True))
    weights = np.take_along_axis(probs / probs.sum(axis=1, keepdims=True), picks, axis=1)
    if renormalize:
        weights /= weights.sum(axis=1, keepdims=True)
    weights[num_live:] = 0.0   # padding tokens weigh nothing
    # f32 softmax against f64: a few f32 ulps
    np.testing.assert_allclose(np.asarray(route.weights), weights, rtol=1e-5, atol=1e-7, err_msg=label)
    groups = np.where((np.arange(tokens)[:, None] < num_live) & (picks >= base) & (picks < base + local),
                      picks - base, -1)
    sizes = np.bincount(groups[groups >= 0], minlength=local)
    starts = np.cumsum(sizes) - sizes
    tile_groups, tile_rows = [], []
    for g in np.nonzero(sizes)[0]:
        first = starts[g] - starts[g] % 8
        n = -(-(starts[g] + sizes[g] - first) // MOE_BLOCK_M)
        tile_groups += [g] * n
        tile_rows += [first + i * MOE_BLOCK_M for i in range(n)]
    num_tiles, max_tiles = len(tile_groups), route.tile_groups.shape[0]
    assert int(route.num_tiles[0]) == num_tiles, label
    np.testing.assert_array_equal(np.asarray(route.tile_groups), tile_groups + [0] * (max_tiles - num_tiles), label)
    np.testing.assert_array_equal(np.asarray(route.tile_rows), tile_rows + [0] * (max_tiles - num_tiles), label)
    pair_rows, sorted_tokens = np.asarray(route.pair_rows), np.asarray(route.sorted_tokens)
    assert (pair_rows[groups < 0] == max_tiles * MOE_BLOCK_M).all(), label
    tile, place = pair_rows[groups >= 0] // MOE_BLOCK_M, pair_rows[groups >= 0] % MOE_BLOCK_M
    assert (tile < num_tiles).all() and (route.tile_groups[tile] == groups[groups >= 0]).all(), label
    rows = np.asarray(route.tile_rows)[tile] + place
    assert (sorted_tokens[rows] == np.nonzero(groups >= 0)[0]).all(), label
    assert sorted(rows.tolist()) == list(range(int(sizes.sum()))), label   # each sorted row holds one pair
    for g in np.nonzero(sizes)[0]:
        assert (rows[groups[groups >= 0] == g] >= starts[g]).all(), label   # with the above: contiguous, in order
        assert (rows[groups[groups >= 0] == g] < starts[g] + sizes[g]).all(), label
    assert not sorted_tokens[int(sizes.sum()):].any(), label


def run_moe_route(route, tokens, experts, top_k, local, base, live, renormalize, dtype, rng):
    logits = moe_logits(rng, tokens, experts, dtype)
    call = jax.jit(functools.partial(route, top_k=top_k, renormalize=renormalize, local_experts=local,
                                     block_m=MOE_BLOCK_M))
    return logits, call(logits, jnp.asarray([live], jnp.int32), jnp.asarray([base], jnp.int32))


@pytest.mark.parametrize("tokens, experts, top_k, local, base, live, renormalize, dtype", MOE_ROUTE_CASES)
def test_moe_route_reference_plans_every_pair(tokens, experts, top_k, local, base, live, renormalize, dtype):
    seed, rng = fresh_rng()
    logits, route = run_moe_route(cc.moe_route_reference, tokens, experts, top_k, local, base, live, renormalize,
                                  dtype, rng)
    check_routing(route, logits, live, base, top_k, renormalize, local, f"seed {seed}")


# ---------------------------------------------------------------- CPU: argument checks and fallback

@pytest.mark.parametrize("change,field", [
    (dict(q=jnp.zeros((2, 8, 64), jnp.bfloat16)), "^q must be"),
    (dict(q=jnp.zeros((2, 8, 64), FP8), k_cache=jnp.zeros((5, 16, 4, 64), FP8),
          v_cache=jnp.zeros((5, 16, 4, 64), FP8)), "^q must be"),
    (dict(q=jnp.zeros((2, 6, 64))), "q heads"),
    (dict(kv_lens=jnp.zeros((2,), jnp.float32)), "kv_lens"),
    (dict(block_tables=jnp.zeros((3, 4), jnp.int32)), "block_tables"),
    (dict(v_cache=jnp.zeros((5, 16, 4, 64), jnp.float16)), "v_cache"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
])
def test_decode_rejects_bad_arguments(change, field):
    args = dict(q=jnp.zeros((2, 8, 64)), k_cache=jnp.zeros((5, 16, 4, 64)), v_cache=jnp.zeros((5, 16, 4, 64)),
                kv_lens=jnp.zeros((2,), jnp.int32), block_tables=jnp.zeros((2, 4), jnp.int32), sm_scale=0.125)
    args.update(change)
    with pytest.raises(ValueError, match=field):
        cc.paged_decode_attention(**args)


def test_cache_ops_reject_bad_arguments():
    cache = jnp.zeros((5, 16, 4, 64))
    with pytest.raises(ValueError, match="slot_mapping"):
        cc.reshape_and_cache(cache, cache, jnp.zeros((3, 4, 64)), jnp.zeros((3, 4, 64)), jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="^v must be"):
        cc.reshape_and_cache(cache, cache, jnp.zeros((3, 4, 64)), jnp.zeros((2, 4, 64)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="same length"):
        cc.copy_blocks(cache, cache, jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32))
    for dtype in (jnp.int8, jnp.float8_e5m2):
        with pytest.raises(ValueError, match="k_cache dtype"):
            cc.copy_blocks(cache.astype(dtype), cache.astype(dtype), jnp.zeros((1,), jnp.int32),
                           jnp.zeros((1,), jnp.int32))


def fp8_linear_case(rng, rows: int, k: int, n: int):
    """bf16 x [rows, k], every finite e4m3 bit pattern in w [n, k], positive f32 scales [n]."""
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, n) * 2.0 ** rng.integers(-12, 4, n), jnp.float32)
    return x, jnp.asarray(random_values(rng, (n, k), FP8)), scale


def bf16_linear_case(rng, rows: int, k: int, n: int):
    """bf16 x [rows, k] and w [k, n], w's magnitudes spread over 2^-16 .. 2^15 (-0 among them)."""
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = rng.standard_normal((k, n)) * 2.0 ** rng.integers(-16, 16, (k, n))
    return x, jnp.asarray(np.where(rng.random((k, n)) < 0.01, -0.0, w), jnp.bfloat16)


def linear_bound(x, w, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """(x w in f64, the error allowed in bf16 out) for w [K, N], or with a scale e4m3 w [N, K] times it: the
    output's rounding to bf16 (2^-8 of itself, two roundings' worth) plus f32 summation in any order over K
    ((K + 2) 2^-24 sum |x w|)."""
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    wd = wd if scale is None else wd.T * np.asarray(scale, np.float64)
    ref = xd @ wd
    return ref, 2.0 ** -8 * np.abs(ref) + (xd.shape[1] + 2) * 2.0 ** -24 * (np.abs(xd) @ np.abs(wd))


def test_fp8_linear_reference_matches_f64():
    seed, rng = fresh_rng()
    x, w, scale = fp8_linear_case(rng, 5, 128, 96)
    ref, bound = linear_bound(x, w, scale)
    out = np.asarray(cc.fp8_linear_reference(x, w, scale), np.float64)
    assert out.shape == (5, 96) and np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), f"seed {seed}"


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
def test_fp8_linear_without_the_library_runs_the_reference_per_weight():
    seed, rng = fresh_rng()
    x, w, scale = fp8_linear_case(rng, 3, 128, 64)
    _, w2, scale2 = fp8_linear_case(rng, 3, 128, 32)
    outs = cc.fp8_linear(x, [w, w2], [scale, scale2])
    for out, ref in zip(outs, (cc.fp8_linear_reference(x, w, scale), cc.fp8_linear_reference(x, w2, scale2))):
        assert_same_bits(out, ref, seed)


def gated_bound(x, cases) -> tuple[np.ndarray, np.ndarray]:
    """(silu(gate) * up in f64, the error allowed in bf16 out) for the (e4m3 w [N, K], scale [N]) of gate and up:
    the output's rounding (2^-8 of itself) plus each sum's error in f32 (linear_bound's less its rounding, and
    the scale's product) carried through the product; silu's slope stays below 1.1."""
    (g, g_bound), (u, u_bound) = (linear_bound(x, w, scale) for w, scale in cases)
    eg, eu = ((b - 2.0 ** -8 * np.abs(v)) + 2.0 ** -22 * np.abs(v) for v, b in ((g, g_bound), (u, u_bound)))
    with np.errstate(over="ignore"):   # exp(-g) of a large -g is inf, and silu 0
        silu = g / (1 + np.exp(-g))
    ref = silu * u
    return ref, 2.0 ** -8 * np.abs(ref) + 1.1 * eg * (np.abs(u) + eu) + np.abs(silu) * eu


def test_fp8_gated_linear_reference_matches_f64():
    seed, rng = fresh_rng()
    x, *gate = fp8_linear_case(rng, 5, 128, 96)
    up = fp8_linear_case(rng, 5, 128, 96)[1:]
    ref, bound = gated_bound(x, (gate, up))
    out = np.asarray(cc.fp8_gated_linear_reference(x, *gate, *up), np.float64)
    assert out.shape == (5, 96) and np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), f"seed {seed}"


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
def test_fp8_gated_linear_without_the_library_runs_the_reference():
    seed, rng = fresh_rng()
    x, *gate = fp8_linear_case(rng, 3, 128, 64)
    up = fp8_linear_case(rng, 3, 128, 64)[1:]
    assert_same_bits(cc.fp8_gated_linear(x, *gate, *up, live=jnp.int32(2)),
                     cc.fp8_gated_linear_reference(x, *gate, *up, jnp.int32(2)), seed)


def test_fp8_gated_linear_rejects_gate_and_up_of_two_shapes():
    x, w, scale = jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((64, 128), FP8), jnp.ones(64)
    with pytest.raises(ValueError, match="gate and up must be of one shape"):
        cc.fp8_gated_linear(x, w, scale, w[:32], scale[:32])
    with pytest.raises(ValueError, match="fp8_gated_linear: x must be bfloat16"):
        cc.fp8_gated_linear(x.astype(jnp.float32), w, scale, w, scale)


@pytest.mark.parametrize("change,field", [
    (dict(x=jnp.zeros((2, 128), jnp.float32)), "bfloat16"), (dict(w=jnp.zeros((64, 128), jnp.bfloat16)), "e4m3fn"),
    (dict(x=jnp.zeros((17, 128), jnp.bfloat16)), "1 to 16, K"),
    (dict(w=jnp.zeros((48, 128), FP8), scale=jnp.ones(48)), "multiple of 32"),
    (dict(x=jnp.zeros((2, 96), jnp.bfloat16), w=jnp.zeros((64, 96), FP8)), "K must be a multiple of 64"),
    (dict(scale=jnp.ones(32)), "scale"), (dict(w=jnp.zeros((64, 64), FP8)), "N, 128"),
    (dict(launch=(3, 1, 2)), "splits must be in"), (dict(launch=(1, 2, 4)), "multiple of 16 \\* warp_tiles"),
    (dict(launch=(1, 4, 2)), "warps_n must be"), (dict(launch=(1, 1, 3)), "warp_tiles one of")])
def test_fp8_linear_rejects_what_the_kernel_cannot_take(change, field):
    args = dict(x=jnp.zeros((2, 128), jnp.bfloat16), w=jnp.zeros((64, 128), FP8), scale=jnp.ones(64), launch=None)
    args.update(change)
    with pytest.raises(ValueError, match=field):
        cc.fp8_linear(args.pop("x"), [args.pop("w")], [args.pop("scale")], **args)


def test_bf16_linear_reference_matches_f64():
    seed, rng = fresh_rng()
    x, w = bf16_linear_case(rng, 5, 128, 96)
    ref, bound = linear_bound(x, w)
    out = np.asarray(cc.bf16_linear_reference(x, w), np.float64)
    assert out.shape == (5, 96) and np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), f"seed {seed}"


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
def test_bf16_linear_without_the_library_runs_the_reference_per_weight():
    seed, rng = fresh_rng()
    x, w = bf16_linear_case(rng, 3, 128, 64)
    w2 = bf16_linear_case(rng, 3, 128, 32)[1]
    outs = cc.bf16_linear(x, [w, w2], live=jnp.int32(2))
    for out, ref in zip(outs, (cc.bf16_linear_reference(x, w, jnp.int32(2)), cc.bf16_linear_reference(x, w2))):
        assert_same_bits(out[:2], ref[:2], seed)
        assert not np.asarray(out[2:], np.float32).any()


@pytest.mark.parametrize("change,field", [
    (dict(x=jnp.zeros((2, 128), jnp.float32)), "bfloat16 \\[1 to 16"),
    (dict(w=jnp.zeros((128, 64), FP8)), "bfloat16 \\[128, N"),
    (dict(x=jnp.zeros((17, 128), jnp.bfloat16)), "1 to 16, K"),
    (dict(w=jnp.zeros((64, 128), jnp.bfloat16)), "\\[128, N\\]"),
    (dict(w=jnp.zeros((128, 48), jnp.bfloat16)), "multiple of 32"), (dict(ws=4), "1 to 3 weights"),
    (dict(launch=(3, 1, 2)), "splits must be in"), (dict(launch=(1, 2, 4), w=jnp.zeros((128, 96), jnp.bfloat16)),
                                                    "multiple of 16 \\* warp_tiles")])
def test_bf16_linear_rejects_what_the_kernel_cannot_take(change, field):
    args = dict(x=jnp.zeros((2, 128), jnp.bfloat16), w=jnp.zeros((128, 64), jnp.bfloat16), ws=1, launch=None)
    args.update(change)
    with pytest.raises(ValueError, match=field) as error:
        cc.bf16_linear(args["x"], [args["w"]] * args["ws"], launch=args["launch"])
    assert str(error.value).startswith("decode linear" if "launch" in change else "bf16_linear")


@pytest.mark.parametrize("k,ns", [(2048, (4096, 512, 512)), (4096, (2048,)), (2048, (128,)), (14336, (4096,)),
                                  (4096, (14336, 14336)), (576, (576, 192, 192)), (1024, (96, 32)), (128, (32,))])
@pytest.mark.parametrize("sms", [132, 78])
def test_bf16_launch_choice_is_one_the_kernel_takes(k, ns, sms):
    """Every shape gets a launch the kernel takes, its splits meeting in a cluster: the fewest splits that give
    BF16_LINEAR_MIN_FILL of the SMs a CTA, or, where none does, as many CTAs as any launch gives."""
    splits, warps_n, warp_tiles = launch = cc.choose_bf16_launch(ns, k, sms)
    cc.check_linear_launch(launch, ns, k)
    assert splits <= cc.DECODE_LINEAR_CLUSTER_SPLITS
    ctas = sum(ns) // (16 * warps_n * warp_tiles) * splits
    most = max(sum(ns) // (16 * w * t) * s for w in cc.DECODE_LINEAR_WARPS_N for t in cc.DECODE_LINEAR_WARP_TILES
               for s in range(1, max(1, min(k // cc.DECODE_LINEAR_CHUNK_K // 4, cc.DECODE_LINEAR_CLUSTER_SPLITS)) + 1)
               if not any(n % (16 * w * t) for n in ns))
    if most < cc.BF16_LINEAR_MIN_FILL * sms:
        assert ctas == most
    else:
        assert ctas >= cc.BF16_LINEAR_MIN_FILL * sms
        assert splits == 1 or sum(ns) // 32 * (splits - 1) < cc.BF16_LINEAR_MIN_FILL * sms


@pytest.mark.skipif(ON_GPU, reason="the fallback path runs only without an NVIDIA GPU")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_fallback_logs_once_and_returns_reference_results(caplog, cache_dtype):
    """Without a GPU the notice is logged once, at INFO (expected there: no warning on the default CPU path)."""
    cc.unavailable_reason.cache_clear()
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[20, 3], q_heads=8, kv_heads=2, head_dim=64, cache_dtype=cache_dtype)
    with caplog.at_level(logging.INFO, logger="custom_calls"):
        k_cache, v_cache = cc.reshape_and_cache(case["k_cache"], case["v_cache"], case["new_k"], case["new_v"],
                                                case["slots"])
        out = cc.paged_decode_attention(case["q"], k_cache, v_cache, case["kv_lens"], case["block_tables"],
                                        sm_scale=0.125, soft_cap=20.0)
        cc.copy_blocks(k_cache, v_cache, jnp.array([1], jnp.int32), jnp.array([4], jnp.int32))
    notices = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "custom_calls"]
    assert len(notices) == 1 and notices[0][0] == logging.INFO and "no NVIDIA GPU" in notices[0][1], notices
    assert not cc.available()
    ref_k, ref_v = cc.reshape_and_cache_reference(case["k_cache"], case["v_cache"], case["new_k"], case["new_v"],
                                                  case["slots"])
    ref = cc.paged_decode_attention_reference(case["q"], ref_k, ref_v, case["kv_lens"], case["block_tables"],
                                              sm_scale=0.125, soft_cap=20.0)
    np.testing.assert_array_equal(out, ref, err_msg=f"seed {seed}")


@pytest.mark.parametrize("change, message", [
    ({"top_k": 0}, "top_k must be in"), ({"top_k": 33}, "top_k must be in"), ({"top_k": 9, "experts": 8}, "top_k"),
    ({"local_experts": 0}, "local_experts must be in"), ({"local_experts": 129}, "local_experts must be in"),
    ({"dtype": jnp.int32}, "logits must be float32 or bfloat16"), ({"block_m": 48}, "block_m must be a power")])
def test_moe_route_rejects_what_the_kernel_cannot_take(change, message):
    case = {"experts": 128, "dtype": jnp.float32, "top_k": 8, "local_experts": 128, "block_m": MOE_BLOCK_M, **change}
    logits = jnp.zeros((4, case["experts"]), case["dtype"])
    with pytest.raises(ValueError, match=message):
        cc.moe_route(logits, jnp.asarray([4]), jnp.asarray([0]), top_k=case["top_k"], renormalize=True,
                     local_experts=case["local_experts"], block_m=case["block_m"])


# ---------------------------------------------------------------- CPU: nvcc build, symbols, registration

@pytest.fixture(scope="session")
def library():
    """A real nvcc build (sm_90a only, to keep CI fast), in the machine's cache as jaxserve keeps it: keyed by the
    sources, flags, nvcc and jax, so a change to any of them builds it again (~130 s on two cores), and a machine
    that built these sources before reuses it."""
    try:
        build.find_nvcc()
    except build.BuildError as err:
        pytest.skip(f"nvcc is not installed on this machine: {err}")
    return build.build_library(archs=("sm_90a",))


@pytest.mark.slow
def test_nvcc_build_exports_ffi_symbols_and_is_cached(library):
    exported = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                              check=True).stdout
    for symbol in SYMBOLS:
        assert f" T {symbol}\n" in exported, f"{symbol} not exported"
    built_at = library.stat().st_mtime_ns
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_CACHE_DIR", str(library.parents[2]))
    try:
        assert build.build_library(archs=("sm_90a",)) == library  # same key: no rebuild
    finally:
        mp.undo()
    assert library.stat().st_mtime_ns == built_at


@pytest.mark.skipif(ON_GPU, reason="on a GPU available() registers the full library; this one would clash")
@pytest.mark.slow
def test_registers_targets_for_cuda_without_gpu(library):
    handle = cc.register(str(library))
    assert all(getattr(handle, symbol) for symbol in SYMBOLS)


@pytest.mark.slow
def test_calls_lower_for_cuda_with_aliases_and_attributes(library):
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[5, 9], q_heads=8, kv_heads=2, head_dim=128, dtype=jnp.bfloat16)

    def step(k_cache, v_cache, new_k, new_v, slots, q, kv_lens, block_tables, x, w, scale, kernel, sent):
        k_cache, v_cache = cc.call_in_place("jaxserve_reshape_and_cache", k_cache, v_cache, jnp.stack([new_k, new_v]),
                                            slots)
        k_cache, v_cache = cc.call_in_place("jaxserve_copy_blocks", k_cache, v_cache, slots[:1], slots[1:])
        norm = jnp.ones(128, jnp.bfloat16)
        rotary = cc.Rotary(jnp.ones(64), q_norm=norm, k_norm=norm, eps=1e-6)
        qkv = jnp.zeros((slots.shape[0], 12 * 128), jnp.bfloat16)
        rotated, k_cache, v_cache = cc.call_rope_and_cache(k_cache, v_cache, qkv, slots, slots, rotary, 8)
        out = cc.call_paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, sm_scale=0.5,
                                             sliding_window=64, soft_cap=30.0, num_splits=3)
        route = cc.call_moe_route(x[:, :16], kv_lens[:1], kv_lens[1:], top_k=3, renormalize=True, local_experts=8,
                                  block_m=64)
        xq, x_scale = cc.call_fp8_quantize_rows(x, x, input=1)
        normed = cc.call_fp8_quantize_rows(x, x[0], input=2, eps=1e-5)
        mm = cc.call_fp8_scaled_mm(cc.call_fp8_quantize_rows(x, input=0)[0], x_scale, w, scale)
        unscaled = cc.call_fp8_mm(xq, w)
        linear = cc.call_decode_linear(x, [w, w[:32]], [scale, scale[:32]], launch=(2, 1, 2), live=kv_lens[0])
        bf16 = cc.call_decode_linear(x, [kernel, kernel[:, :32]], None, launch=(1, 1, 2))
        gated = cc.call_decode_linear(x, [w, w], [scale, scale], launch=(1, 1, 2), gated=True)
        added = cc.call_add_rms_norm(x * 2, x, x[0], 1e-5)
        copied = cc.call_copy_outside_graphs(sent)
        return k_cache, v_cache, out, rotated, linear, bf16, gated, route, xq, normed, mm, unscaled, added, copied

    args = [case[k] for k in ("k_cache", "v_cache", "new_k", "new_v", "slots", "q", "kv_lens", "block_tables")]
    args += [jnp.zeros((3, 128), jnp.bfloat16), jnp.zeros((64, 128), FP8), jnp.ones(64, jnp.float32),
             jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros(1000, jnp.uint8)]
    text = jax.jit(step, donate_argnums=(0, 1)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for target in cc.TARGETS:
        assert f"stablehlo.custom_call @{target}(" in text
    assert text.count("output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], "
                      "operand_index = 0") == 3
    # add_rms_norm: (normed, sum), the sum over x's buffer
    assert re.search(r"@jaxserve_add_rms_norm\(.*output_operand_aliases = \[#stablehlo.output_operand_alias<"
                     r"output_tuple_indices = \[1\], operand_index = 0", text)
    for attr in ("num_splits = 3 : i32", "sliding_window = 64 : i32", "sm_scale = 5.000000e-01 : f32",
                 "soft_cap = 3.000000e+01 : f32", "num_q_heads = 8 : i32", "eps = 9.99999997E-7 : f32"):
        assert attr in text, attr
    assert "tensor<2x8x128xbf16>, tensor<6240xf32>" in text  # out + workspace B*Hq*S*(D+2)
    # rope_and_cache: inv_freq, the q and k norms' weights, k's and v's scales per kv head; then q [T, Hq, D]
    assert "tensor<64xf32>, tensor<128xbf16>, tensor<128xbf16>, tensor<2xf32>, tensor<2xf32>) -> (" in text
    assert re.search(r"-> \(tensor<[\dx]+bf16>, tensor<[\dx]+bf16>, tensor<\d+x8x128xbf16>\)", text)
    assert "tensor<3x64xbf16>, tensor<3x32xbf16>, tensor<576xf32>" in text  # the ys + workspace S*M*sum(N)
    for attr in ("splits = 2 : i32", "warps_n = 1 : i32", "warp_tiles = 2 : i32", "with_live = 1 : i32",
                 "weights_kn = 0 : i32", "splits = 1 : i32", "weights_kn = 1 : i32", "gated = 0 : i32",
                 "gated = 1 : i32"):
        assert attr in text, attr
    # gated: gate and up with their scales, one y of their N and a one-element workspace
    assert "(tensor<3x128xbf16>, tensor<64x128xf8E4M3FN>, tensor<64xf32>, tensor<64x128xf8E4M3FN>, tensor<64xf32>) " \
           "-> (tensor<3x64xbf16>, tensor<1xf32>)" in text
    # bf16 weights [K, N], no scales: the ys and a one-element workspace
    assert "(tensor<3x128xbf16>, tensor<128x64xbf16>, tensor<128x32xbf16>) -> (tensor<3x64xbf16>, " \
           "tensor<3x32xbf16>, tensor<1xf32>)" in text
    for attr in ("top_k = 3 : i32", "renormalize = 1 : i32", "local_experts = 8 : i32", "block_m = 64 : i32",
                 "row_align = 8 : i32"):
        assert attr in text, attr
    # weights, sorted tokens (9 pairs, a 64-row margin, 8-row tiles), the plan's tiles ((9 + 8 * 70) / 64 at most)
    assert "tensor<3x3xf32>, tensor<80xi32>, tensor<9xi32>, tensor<9xi32>, tensor<1xi32>, tensor<3x3xi32>" in text
    assert "(tensor<3x128xbf16>, tensor<3x128xbf16>) -> (tensor<3x128xf8E4M3FN>, tensor<3x1xf32>)" in text  # gated
    assert "(tensor<3x128xbf16>, tensor<128xbf16>) -> (tensor<3x128xf8E4M3FN>, tensor<3x1xf32>)" in text  # normed
    for attr in ("input = 1 : i32", "input = 2 : i32", "eps = 9.99999974E-6 : f32"):
        assert attr in text, attr
    assert f"-> (tensor<3x64xbf16>, tensor<{cc.FP8_SCALED_MM_WORKSPACE}xui8>)" in text  # y + cuBLASLt's workspace
    assert "(tensor<1000xui8>) -> tensor<1000xui8>" in text   # copy_outside_graphs


# ---------------------------------------------------------------- GPU: CUDA ops vs references

def poison_device_memory(shape, dtype):
    """Leaves NaN in freed device memory the next allocation of this size is likely to reuse."""
    jnp.full(shape, jnp.nan, dtype).block_until_ready()


def run_decode_step(case, kw, num_splits, cuda: bool):
    decode = cc.paged_decode_attention if cuda else cc.paged_decode_attention_reference
    write = cc.reshape_and_cache if cuda else cc.reshape_and_cache_reference
    split_kw = dict(num_splits=num_splits) if cuda else {}

    def step(k_cache, v_cache, new_k, new_v, slots, q, kv_lens, block_tables):
        k_cache, v_cache = write(k_cache, v_cache, new_k, new_v, slots)
        return k_cache, v_cache, decode(q, k_cache, v_cache, kv_lens, block_tables, **kw, **split_kw)

    args = [case[k] for k in ("k_cache", "v_cache", "new_k", "new_v", "slots", "q", "kv_lens", "block_tables")]
    args[:2] = [jnp.array(a, copy=True) for a in args[:2]]  # the step donates these
    poison_device_memory(case["q"].shape, case["q"].dtype)
    return jax.jit(step, donate_argnums=(0, 1))(*args)


# TOLERANCE[q's dtype] holds for an FP8 cache too: the kernel and the reference read identical e4m3 values,
# widened exactly to f32, so they differ only in f32 summation order and then the output's rounding to q's dtype.
@needs_gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (16, 4), (16, 2), (40, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_step_matches_reference(cache_dtype, dtype, q_heads, kv_heads, head_dim):
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[1, 77, 0, 300, 16, 1029], q_heads=q_heads, kv_heads=kv_heads,
                           head_dim=head_dim, block_size=16, max_blocks=70, dtype=dtype, cache_dtype=cache_dtype)
    kw = decode_kwargs(head_dim, None, None)
    ref_k, ref_v, ref = run_decode_step(case, kw, None, cuda=False)
    for splits in (None, 1, 3):
        k_cache, v_cache, out = run_decode_step(case, kw, splits, cuda=True)
        assert_same_bits(k_cache, ref_k, seed)
        assert_same_bits(v_cache, ref_v, seed)
        assert rel_err(out, ref) <= TOLERANCE[dtype], f"seed {seed} splits {splits}"
        assert not np.asarray(out[2], np.float32).any(), "padding row must be zeros"


@needs_gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,cap,block_size", [(100, None, 16), (None, 50.0, 8), (33, 10.0, 32)])
def test_decode_window_and_soft_cap_match_reference(cache_dtype, dtype, window, cap, block_size):
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[513, 5, 0, 260, 99], q_heads=32, kv_heads=8, head_dim=128,
                           block_size=block_size, dtype=dtype, cache_dtype=cache_dtype)
    kw = decode_kwargs(128, window, cap)
    _, _, ref = run_decode_step(case, kw, None, cuda=False)
    for splits in (None, 1, 4):
        _, _, out = run_decode_step(case, kw, splits, cuda=True)
        assert rel_err(out, ref) <= TOLERANCE[dtype], f"seed {seed} splits {splits}"


@needs_gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (100, 30.0)])
def test_decode_partials_merge_to_the_reference(cache_dtype, dtype, window, cap):
    """The call's splits unmerged (the workspace poisoned first): one split gives the reference's attention and
    log2-sum-exp; 1, 3 and 16 splits merged by their log2-sum-exps give its attention, and their log2-sum-exps its
    own; a row with no keys gets zeros and -inf in every split."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    case = make_paged_case(rng, lens=[513, 5, 0, 260, 99], q_heads=32, kv_heads=8, head_dim=128, dtype=dtype,
                           cache_dtype=cache_dtype)
    k_cache, v_cache = cc.reshape_and_cache_reference(case["k_cache"], case["v_cache"], case["new_k"],
                                                      case["new_v"], case["slots"])
    args = (case["q"], k_cache, v_cache, case["kv_lens"], case["block_tables"])
    kw = decode_kwargs(128, window, cap)
    ref, ref_lse = cc.paged_decode_partials_reference(*args, **kw)
    for splits in (1, 3, 16):
        poison_device_memory((5 * 32 * splits * 130,), jnp.float32)
        out, lse = jax.jit(functools.partial(cc.paged_decode_partials, **kw, num_splits=splits))(*args)
        assert out.shape == (5, splits, 32, 128) and lse.shape == (5, splits, 32)
        assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any(), f"seed {seed}"
        total = jax.nn.logsumexp(lse * math.log(2), axis=1) / math.log(2)
        merged = jnp.sum(out * jnp.exp2(lse - jnp.where(jnp.isfinite(total), total, 0)[:, None])[..., None], axis=1)
        assert rel_err(merged, ref[:, 0]) <= TOLERANCE[dtype], f"seed {seed} splits {splits}"   # P's rounding
        live = np.isfinite(np.asarray(ref_lse[:, 0]))
        assert np.array_equal(np.isfinite(np.asarray(total)), live), f"seed {seed} splits {splits}"
        np.testing.assert_allclose(np.asarray(total)[live], np.asarray(ref_lse[:, 0])[live], rtol=1e-5, atol=1e-4,
                                   err_msg=f"seed {seed} splits {splits}")   # float32 sums over up to 513 keys
        assert not np.asarray(out[2]).any(), "a row with no keys must be zeros"


def large_fp8_decode_step(rng, kernels, max_len=300, rows=256):
    """A decode-only step of `rows` rows (the last one padding) over an FP8 cache, jitted through the model's paged
    attention with `kernels`: (case, step, its args)."""
    from jaxserve.models import attention

    lens = np.concatenate([rng.integers(1, max_len, rows - 1), [0]])
    case = make_paged_case(rng, lens=lens, q_heads=32, kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                           cache_dtype=FP8)
    batch = attention.AttentionBatch(case["slots"], jnp.arange(rows + 1, dtype=jnp.int32), case["kv_lens"],
                                     case["block_tables"], jnp.array([rows - 1], jnp.int32), decode_only=True)
    step = jax.jit(functools.partial(attention.paged_attention, kernels=kernels, sm_scale=0.125, sliding_window=None))
    return case, step, (case["q"], case["new_k"], case["new_v"], (case["k_cache"], case["v_cache"]), batch)


def test_large_fp8_decode_steps_lower_to_the_call_for_cuda(monkeypatch):
    """Lowered for CUDA, a large decode-only step over an FP8 cache runs the CUDA call under the kernels "auto"
    resolves on sm_90 (cuda_decodes), and the Pallas path's kernel otherwise."""
    from jaxserve.models.attention import AttentionKernels

    monkeypatch.setattr(cc, "available", lambda: True)
    monkeypatch.setattr(cc, "sm_count", lambda: 132)
    for kernels, call in ((AttentionKernels("pallas", "auto", cuda_decodes=True), True),
                          (AttentionKernels("pallas", "auto"), False)):
        _, step, args = large_fp8_decode_step(np.random.default_rng(0), kernels, max_len=20)
        text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert ("custom_call @jaxserve_paged_decode_attention" in text) == call


@needs_gpu
def test_large_fp8_decode_steps_run_the_tensor_core_call():
    """On the GPU, the same step writes its tokens and attends through the CUDA call (in the compiled step) to the
    reference's output, as the Pallas launch the unmarked kernels keep does."""
    from jaxserve.models.attention import AttentionKernels
    from pallas_kernels.ragged_paged_attention import FP8_MIN_CAPABILITY, gpu_capability

    if gpu_capability() < FP8_MIN_CAPABILITY:
        pytest.skip("the Pallas launch it is held beside reads FP8 caches on sm_89+ only")
    seed, rng = fresh_rng()
    for kernels, call in ((AttentionKernels("pallas", "auto", cuda_decodes=True), True),
                          (AttentionKernels("pallas", "auto"), False)):
        case, step, args = large_fp8_decode_step(rng, kernels)
        k, v = cc.reshape_and_cache_reference(case["k_cache"], case["v_cache"], case["new_k"], case["new_v"],
                                              case["slots"])
        ref = cc.paged_decode_attention_reference(case["q"], k, v, case["kv_lens"], case["block_tables"],
                                                  sm_scale=0.125)
        assert ("jaxserve_paged_decode_attention" in step.lower(*args).as_text()) == call
        poison_device_memory(case["q"].shape, case["q"].dtype)
        out, _ = step(*args)
        assert rel_err(out, ref) <= TOLERANCE[jnp.bfloat16], f"seed {seed} call {call}"
        assert not np.asarray(out[-1], np.float32).any(), "padding row must be zeros"


class FakeHopper:
    platform, compute_capability, core_count = "gpu", "9.0", 132


# mixed steps over each cache: (cache dtype, sequence slots, tokens), and whether the CUDA call takes the decodes
MIXED_STEPS = [pytest.param(FP8, 8, 96, True, id="fp8"),   # over an FP8 cache at any batch
               pytest.param(None, 256, 320, True, id="bf16-256"),   # over q's dtype from CUDA_DECODE_MIN_ROWS
               pytest.param(None, 8, 96, False, id="bf16-8")]   # else the Mosaic GPU decode


def mixed_step(rng, cache, slots, tokens):
    """A mixed step (three decodes, a chunk over cached context, a prompt, padding tokens) over a bf16 or FP8 cache,
    jitted through the model's attention over the written pages with the kernels "auto" resolves on sm_90
    (cuda_decodes): (batch, the step unjitted, its args)."""
    from helpers import GEOMETRY, cached_as, make_batch
    from jaxserve.models import attention

    shape = {**GEOMETRY, "q_heads": 16, "kv_heads": 4, "num_tokens": tokens, "max_seqs": slots, "max_blocks": 16,
             "num_blocks": 64}
    batch = cached_as(make_batch(rng, [1, 1, 1, 30, 41], [33, 5, 80, 71, 41], **shape, dtype=jnp.bfloat16), cache)
    meta = attention.AttentionBatch(jnp.zeros(shape["num_tokens"], jnp.int32), batch.cu_q_lens, batch.kv_lens,
                                    batch.block_tables, batch.num_seqs)
    kernels = attention.AttentionKernels("pallas", "auto", cuda_decodes=True)
    step = functools.partial(attention.attend_pages, kernels=kernels, num_layers=1, layer=0, sm_scale=0.125,
                             sliding_window=None)
    return batch, step, (batch.q, batch.k_cache, batch.v_cache, meta)


@pytest.mark.parametrize("cache, slots, tokens, call", MIXED_STEPS)
def test_mixed_steps_lower_to_the_call_and_mosaic_only_for_cuda(monkeypatch, cache, slots, tokens, call):
    """Lowered for CUDA on Hopper, a mixed step under "auto" runs its decodes through the CUDA call where decode_on_cuda
    says, else through the Mosaic GPU decode, and its other rows through the Mosaic GPU prefill: no Triton kernel,
    no other custom call. Three layers' calls in one step lower each Mosaic GPU kernel once (its Python lowering
    takes ~0.5 s a kernel: ~16 s more a graph at 32 layers)."""
    monkeypatch.setattr(cc, "available", lambda: True)
    monkeypatch.setattr(cc, "sm_count", lambda: 132)
    monkeypatch.setattr(jax, "devices", lambda *_: [FakeHopper()])
    _, step, args = mixed_step(np.random.default_rng(0), cache, slots, tokens)
    layers = jax.jit(lambda q, *rest: sum(step(q * (i + 1), *rest) for i in range(3)))
    text = layers.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    expected = {"jaxserve_paged_decode_attention", "mosaic_gpu_v2"} if call else {"mosaic_gpu_v2"}
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == expected
    assert text.count("custom_call @mosaic_gpu_v2") == (1 if call else 2)   # the prefill, and the decode if Mosaic's


@pytest.mark.parametrize("cache, rows, call", [pytest.param(*p.values[:2], p.values[3], id=p.id)
                                               for p in MIXED_STEPS])
def test_cascade_steps_read_their_own_keys_through_the_call_for_cuda(monkeypatch, cache, rows, call):
    """Lowered for CUDA on Hopper, a cascade step under "auto" reads its groups' shared prefixes through the Mosaic
    GPU cascade and its rows' own keys through the CUDA call where decode_on_cuda says, else through the Mosaic GPU
    decode: no Triton kernel, no other custom call, each Mosaic GPU kernel lowered once for three layers."""
    from jaxserve.models import attention
    from pallas_kernels.cascade_attention import CascadeGroups

    monkeypatch.setattr(cc, "available", lambda: True)
    monkeypatch.setattr(cc, "sm_count", lambda: 132)
    monkeypatch.setattr(jax, "devices", lambda *_: [FakeHopper()])
    groups = 4
    cache_shape = jax.ShapeDtypeStruct((512, 16, 8, 128), cache or jnp.bfloat16)
    ints = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((rows,), (rows, 32), (1,), (rows,), (rows,),
                                                                 (groups + 1,), (groups,), (groups,), (1,))]
    kernels = attention.AttentionKernels("pallas", "auto", cuda_decodes=True)

    def layers(q, k_cache, v_cache, kv_lens, tables, num_seqs, *cascade):
        batch = attention.AttentionBatch(jnp.zeros(rows, jnp.int32), jnp.arange(rows + 1, dtype=jnp.int32), kv_lens,
                                         tables, num_seqs, decode_only=True, cascade=CascadeGroups(*cascade))
        return sum(attention.attend_pages(q * (i + 1), k_cache, v_cache, batch, kernels, 1, 0, sm_scale=0.125,
                                          sliding_window=None) for i in range(3))

    q = jax.ShapeDtypeStruct((rows, 32, 128), jnp.bfloat16)
    text = jax.jit(layers).trace(q, cache_shape, cache_shape, *ints).lower(lowering_platforms=("cuda",)).as_text()
    expected = {"jaxserve_paged_decode_attention", "mosaic_gpu_v2"} if call else {"mosaic_gpu_v2"}
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == expected
    assert text.count("custom_call @mosaic_gpu_v2") == (1 if call else 2)   # the shared pass, and the own if Mosaic's
    assert text.count("custom_call @jaxserve_paged_decode_attention") == call   # in the jitted cascade, once


@needs_gpu
@pytest.mark.parametrize("cache, slots, tokens, call", MIXED_STEPS)
def test_mixed_steps_run_their_decodes_through_the_call(cache, slots, tokens, call):
    """On Hopper, the same steps compiled hold the call where said and give the reference's output (the decodes' rows
    from the call, the others from the Mosaic prefill), their padding rows zeros."""
    from helpers import check_close, on_hopper, poison_allocator
    from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

    if not on_hopper():
        pytest.skip("the Mosaic GPU prefill it runs beside needs sm_90")
    seed, rng = fresh_rng()
    batch, step, args = mixed_step(rng, cache, slots, tokens)
    step = jax.jit(step)
    assert ("jaxserve_paged_decode_attention" in step.lower(*args).as_text()) == call
    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125)
    poison_allocator(batch)
    check_close(step(*args), expected, batch, jnp.bfloat16, f"seed {seed}")


@needs_gpu
@pytest.mark.parametrize("size", [1, 1237, 300_001, 0])
def test_copy_outside_graphs_gives_the_bytes(size):
    """Odd sizes (no 16-byte multiple), the empty buffer; the output's memory poisoned first, so a byte the call
    did not write shows."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.integers(0, 256, size, dtype=np.uint8))
    jnp.full(size, 0xA5, jnp.uint8).block_until_ready()   # poison: freed memory the output is likely to reuse
    copy = jax.jit(cc.copy_outside_graphs)
    assert "jaxserve_copy_outside_graphs" in copy.lower(x).as_text()
    assert_same_bits(copy(x), x, seed)


@pytest.mark.parametrize("x", [np.zeros(8, np.int8), np.zeros((2, 4), np.uint8)])
def test_copy_outside_graphs_refuses_what_is_not_bytes(x):
    with pytest.raises(ValueError, match="copy_outside_graphs takes uint8"):
        cc.copy_outside_graphs(jnp.asarray(x))


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, FP8])
def test_copy_blocks_in_place_matches_reference(dtype):
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    shape = (64, 16, 8, 128)
    k_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), dtype).at[0].set(jnp.nan)
    blocks = rng.permutation(64).astype(np.int32)
    src, dst = jnp.asarray(blocks[:10]), jnp.asarray(blocks[10:20]).at[3].set(-1)  # pair 3 skipped
    ref_k, ref_v = cc.copy_blocks_reference(k_cache, v_cache, src, dst)
    step = jax.jit(cc.copy_blocks, donate_argnums=(0, 1))
    k_out, v_out = step(jnp.array(k_cache, copy=True), jnp.array(v_cache, copy=True), src, dst)
    assert_same_bits(k_out, ref_k, seed)
    assert_same_bits(v_out, ref_v, seed)


@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("k,ns", [(576, (192,)), (4096, (1024,)), (1024, (4096,)), (576, (576, 192, 192))],
                         ids=["smollm_kv", "8b_kv", "k1024", "smollm_qkv"])
@pytest.mark.parametrize("launch", [None, (1, 1, 2), (3, 1, 4), (9, 2, 2), (2, 2, 4)],
                         ids=["auto", "one_split", "cluster_splits", "merged_splits", "wide"])
def test_fp8_linear_matches_f64(rows, k, ns, launch):
    """The kernel over every e4m3 bit pattern (subnormals and -0 included) within linear_bound, for one weight
    and for three of one input, its output memory NaN-poisoned first; splits of K meet in a cluster (up to 8) or
    through the workspace (more)."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    cases = [fp8_linear_case(rng, rows, k, n)[1:] for n in ns]
    ws, scales = [w for w, _ in cases], [s for _, s in cases]
    if launch and any(n % (16 * launch[1] * launch[2]) for n in ns):   # N = 192 in tiles of 128
        with pytest.raises(ValueError, match="must be a multiple"):
            cc.fp8_linear(x, ws, scales, launch=launch)
        return
    poison_device_memory((rows, sum(ns)), jnp.bfloat16)
    outs = jax.jit(lambda x, ws, ss: cc.fp8_linear(x, ws, ss, launch=launch))(x, ws, scales)
    for out, w, scale in zip(outs, ws, scales):
        ref, bound = linear_bound(x, w, scale)
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())


@needs_gpu
@pytest.mark.parametrize("rows, live", [(16, 1), (16, 9), (16, 8), (8, 3), (16, 0), (16, 16)])
def test_fp8_linear_reads_no_row_past_the_live_ones(rows, live):
    """Given a step's live rows the kernel reads no activation past them (NaN there reaches no output) and writes
    zeros there; the live rows are what the kernel gives on the rows alone, bit for bit."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
    cases = [fp8_linear_case(rng, rows, 4096, n)[1:] for n in (1024, 512, 512)]
    ws, scales = [w for w, _ in cases], [s for _, s in cases]
    poisoned = x.at[live:].set(jnp.nan)
    poison_device_memory((rows, 2048), jnp.bfloat16)
    outs = jax.jit(lambda x, ws, ss, live: cc.fp8_linear(x, ws, ss, live=live))(poisoned, ws, scales,
                                                                               jnp.int32(live))
    alone = jax.jit(lambda x, ws, ss: cc.fp8_linear(x, ws, ss))(x.at[live:].set(0), ws, scales)
    for out, want in zip(outs, alone):
        assert_same_bits(out, want, seed)
        assert not np.asarray(out[live:], np.float32).any(), f"seed {seed}"


@needs_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype,cache_dtype,norms", [(jnp.bfloat16, None, False), (jnp.bfloat16, None, True),
                                                     (jnp.float16, None, True), (jnp.bfloat16, FP8, True),
                                                     (jnp.float16, FP8, False)],
                         ids=["bf16", "bf16-norms", "f16-norms", "fp8-norms", "f16-fp8"])
def test_rope_and_cache_matches_reference(head_dim, dtype, cache_dtype, norms):
    """The CUDA call against the reference on the same operands (GQA 4, a padding token), its q output's memory
    NaN-poisoned first: q and the written rows within two roundings of their dtype (its sin, cos and rsqrt may
    differ from XLA's in the last f32 bit, which a rounding can carry to the dtype's), every other row of the
    caches bit for bit."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    case = rope_case(rng, tokens=9, q_heads=8, kv_heads=2, head_dim=head_dim, dtype=dtype, cache_dtype=cache_dtype,
                     norms=norms)
    rotary, hq = case.pop("rotary"), case.pop("num_q_heads")
    want = cc.rope_and_cache_reference(**case, rotary=rotary, num_q_heads=hq)
    poison_device_memory((9, hq, head_dim), dtype)
    run = jax.jit(lambda k_cache, v_cache, *rest: cc.rope_and_cache(k_cache, v_cache, *rest[:3], rotary, hq,
                                                                   *rest[3:]), donate_argnums=(0, 1))
    args = [jnp.array(case[n], copy=True) if n.endswith("cache") else case[n] for n in
            ("k_cache", "v_cache", "qkv", "positions", "slot_mapping", "k_scale", "v_scale")]
    lowered = run.lower(*args)
    assert "@jaxserve_rope_and_cache(" in lowered.as_text()   # the kernel, not the reference's fallback
    got = lowered.compile()(*args)
    slots = np.asarray(case["slot_mapping"])
    written, kept = slots[slots >= 0], np.setdiff1d(np.arange(32), slots)
    for name, out, ref in zip(("q", "k_cache", "v_cache"), got, want):
        out, ref = np.asarray(out), np.asarray(ref)
        if name != "q":
            out, ref = out.reshape(32, 2, head_dim), ref.reshape(32, 2, head_dim)
            assert_same_bits(out[kept], ref[kept], seed)
            out, ref = out[written], ref[written]
        tol = 2.0 ** -2 if out.dtype == FP8 else 2.0 ** -(7 if dtype == jnp.bfloat16 else 10)
        out, ref = out.astype(np.float64), ref.astype(np.float64)
        assert np.isfinite(out).all(), (name, f"seed {seed}")
        assert np.allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max()), (name, f"seed {seed}",
                                                                               np.abs(out - ref).max())


@needs_gpu
@pytest.mark.parametrize("width", [576, 2048, 4096, 8192])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_add_rms_norm_matches_reference(width, dtype):
    """The CUDA call against the reference as XLA runs it on the GPU, on 1, 16 (a decode bucket) and 300 rows, the
    normed output's memory NaN-poisoned first: the sum bit for bit (both add in f32 and round once), the norm
    within two roundings of the dtype (its sum of squares in another order and rsqrt's last bit may move the
    normalised value by one, the weight's product by one more)."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    reference = jax.jit(cc.add_rms_norm_reference, static_argnums=3)
    for rows in (1, 16, 300):
        x, delta, weight = add_norm_case(rng, rows, width, dtype)
        want_normed, want_total = reference(x, delta, weight, 1e-6)
        poison_device_memory((rows, width), dtype)
        lowered = jax.jit(cc.add_rms_norm, static_argnums=3).lower(x, delta, weight, 1e-6)
        assert "@jaxserve_add_rms_norm(" in lowered.as_text()   # the kernel, not the reference's fallback
        normed, total = lowered.compile()(x, delta, weight)
        assert_same_bits(total, want_total, seed)
        got, want = np.asarray(normed, np.float32), np.asarray(want_normed, np.float32)
        assert np.isfinite(got).all(), f"seed {seed}"
        tol = 2.0 ** -(6 if dtype == jnp.bfloat16 else 9)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 2.0 ** -6, err_msg=f"seed {seed}")


@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 9, 16])
@pytest.mark.parametrize("k,n", [(576, 1536), (4096, 1024), (1024, 4096)], ids=["smollm", "8b_slice", "k1024"])
@pytest.mark.parametrize("launch", [None, (1, 1, 2), (3, 1, 4), (9, 2, 2), (2, 2, 4)],
                         ids=["auto", "one_split", "cluster_splits", "merged_splits", "wide"])
def test_fp8_gated_linear_matches_f64(rows, k, n, launch):
    """silu(gate) * up out of one launch over every e4m3 bit pattern in both weights, within gated_bound, its output
    memory NaN-poisoned first: unsplit, splits meeting in a cluster, and through the workspace."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    gate, up = (fp8_linear_case(rng, rows, k, n)[1:] for _ in range(2))
    poison_device_memory((rows, n), jnp.bfloat16)
    out = jax.jit(lambda x, g, u: cc.fp8_gated_linear(x, *g, *u, launch=launch))(x, gate, up)
    ref, bound = gated_bound(x, (gate, up))
    out = np.asarray(out, np.float64)
    assert out.shape == (rows, n) and np.isfinite(out).all(), f"seed {seed}"
    assert (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())


@needs_gpu
@pytest.mark.parametrize("rows, live", [(16, 1), (16, 9), (8, 3), (16, 0)])
def test_fp8_gated_linear_reads_no_row_past_the_live_ones(rows, live):
    """As test_fp8_linear_reads_no_row_past_the_live_ones, for the gated launch."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
    gate, up = (fp8_linear_case(rng, rows, 4096, 1024)[1:] for _ in range(2))
    poison_device_memory((rows, 1024), jnp.bfloat16)
    out = jax.jit(lambda x, g, u, live: cc.fp8_gated_linear(x, *g, *u, live=live))(x.at[live:].set(jnp.nan), gate, up,
                                                                                  jnp.int32(live))
    alone = jax.jit(lambda x, g, u: cc.fp8_gated_linear(x, *g, *u))(x.at[live:].set(0), gate, up)
    assert_same_bits(out, alone, seed)
    assert not np.asarray(out[live:], np.float32).any(), f"seed {seed}"


@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 9, 16])
@pytest.mark.parametrize("k,ns", [(576, (576, 192, 192)), (2048, (4096, 512, 512)), (4096, (2048,)), (2048, (128,)),
                                  (1024, (96, 32))], ids=["smollm_qkv", "moe_qkv", "moe_o", "router", "narrow"])
@pytest.mark.parametrize("launch", [None, (1, 1, 2), (3, 1, 4), (9, 2, 2), (2, 2, 4)],
                         ids=["auto", "one_split", "cluster_splits", "merged_splits", "wide"])
def test_bf16_linear_matches_f64(rows, k, ns, launch):
    """bf16 weights [K, N] through the kernel within linear_bound of f64, one weight and three of one input, output
    memory NaN-poisoned first; a launch whose tile N does not divide is refused (auto takes two tiles a warp)."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [bf16_linear_case(rng, rows, k, n)[1] for n in ns]
    if launch and any(n % (16 * launch[1] * launch[2]) for n in ns):
        with pytest.raises(ValueError, match="must be a multiple"):
            cc.bf16_linear(x, ws, launch=launch)
        return
    poison_device_memory((rows, sum(ns)), jnp.bfloat16)
    outs = jax.jit(lambda x, ws: cc.bf16_linear(x, ws, launch=launch))(x, ws)
    for out, w in zip(outs, ws):
        ref, bound = linear_bound(x, w)
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())


@needs_gpu
@pytest.mark.parametrize("rows, live", [(16, 1), (16, 9), (8, 3), (16, 0), (16, 16)])
def test_bf16_linear_reads_no_row_past_the_live_ones(rows, live):
    """As test_fp8_linear_reads_no_row_past_the_live_ones, for bf16 weights [K, N]."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = jnp.asarray(rng.standard_normal((rows, 2048)), jnp.bfloat16)
    ws = [bf16_linear_case(rng, rows, 2048, n)[1] for n in (1024, 512, 512)]
    poison_device_memory((rows, 2048), jnp.bfloat16)
    outs = jax.jit(lambda x, ws, live: cc.bf16_linear(x, ws, live=live))(x.at[live:].set(jnp.nan), ws, jnp.int32(live))
    alone = jax.jit(lambda x, ws: cc.bf16_linear(x, ws))(x.at[live:].set(0), ws)
    for out, want in zip(outs, alone):
        assert_same_bits(out, want, seed)
        assert not np.asarray(out[live:], np.float32).any(), f"seed {seed}"


def test_fp8_linear_reference_zeros_the_rows_past_the_live_ones():
    rng = np.random.default_rng(4)
    x, w, scale = fp8_linear_case(rng, 6, 128, 64)
    full = np.asarray(cc.fp8_linear_reference(x, w, scale), np.float32)
    got = np.asarray(cc.fp8_linear_reference(x, w, scale, jnp.int32(4)), np.float32)
    np.testing.assert_array_equal(got[:4], full[:4])
    assert not got[4:].any()


@needs_gpu
@pytest.mark.parametrize("tokens, experts, top_k, local, base, live, renormalize, dtype", MOE_ROUTE_CASES)
def test_moe_route_plans_every_pair(tokens, experts, top_k, local, base, live, renormalize, dtype):
    """The CUDA routing call (one CTA up to 128 tokens, a picking grid then the plan's CTA past them), its outputs'
    memory NaN-poisoned first, against the float64 routing."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    poison_device_memory((tokens, top_k), jnp.float32)
    logits, route = run_moe_route(cc.moe_route, tokens, experts, top_k, local, base, live, renormalize, dtype, rng)
    check_routing(route, logits, live, base, top_k, renormalize, local, f"seed {seed}")


def fp8_rows(rng, rows: int, k: int) -> jax.Array:
    """bf16 rows of magnitudes 2^-8 to 2^8, a row of zeros (a padding token) and a row with one outlier."""
    x = rng.standard_normal((rows, k)) * 2.0 ** rng.integers(-8, 9, (rows, 1))
    x[0] = 0.0
    if rows > 1:
        x[1] = 1e-3
        x[1, rng.integers(k)] = -3e4
    return jnp.asarray(x, jnp.bfloat16)


@needs_gpu
@pytest.mark.parametrize("rows, k, m", [(17, 4096, 1024), (64, 14336, 4096), (256, 14336, 4096), (40, 576, 1536)])
def test_fp8_mm_matches_f64(rows, k, m):
    """cuBLASLt's FP8 GEMM without scales, f32 out, over every e4m3 bit pattern, its output memory NaN-poisoned
    first: the fast accumulation's 2e-3 of sum |x w| allowed (see test_fp8_scaled_mm_matches_f64), and f32's
    rounding of the result."""
    assert cc.has_cublaslt(), "the CUDA library was built without cuBLASLt"
    seed, rng = fresh_rng()
    x, w = random_values(rng, (rows, k), FP8), random_values(rng, (m, k), FP8)
    poison_device_memory((rows, m), jnp.float32)
    out = np.asarray(jax.jit(cc.fp8_mm)(x, w), np.float64)
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = xd @ wd.T
    bound = 2.0 ** -23 * np.abs(ref) + 2e-3 * (np.abs(xd) @ np.abs(wd).T)
    assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())


def test_gemms_of_few_tiles_lower_to_the_unscaled_gemm_for_cuda(monkeypatch):
    """Lowered for CUDA with the library there, a W8A8 GEMM whose output is at most fp8.UNSCALED_GEMM_MAX_TILES
    tiles of 128 x 128 runs fp8_mm (the scales after it), one of more tiles fp8_scaled_mm, by rows and width alike.
    Both give the reference's values: on a GPU within a bf16 rounding (cuBLASLt may sum K in another order than
    XLA's dot), on the CPU exactly."""
    from jaxserve.models import fp8

    rng = np.random.default_rng(0)
    wide = fp8.UNSCALED_GEMM_MAX_TILES // 2 * 128   # two row tiles of this width: the most tiles unscaled
    cases = [(256, 256, wide, "jaxserve_fp8_mm"),
             (64, 512, 2 * wide, "jaxserve_fp8_mm"),
             (256 + 16, 256, wide, "jaxserve_fp8_scaled_mm"),
             (256, 256, wide + 128, "jaxserve_fp8_scaled_mm")]
    for rows, k, m, target in cases:
        xq, w = random_values(rng, (rows, k), FP8), random_values(rng, (m, k), FP8)
        x_scale = rng.uniform(0.5, 2.0, (rows, 1)).astype(np.float32)
        w_scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
        out = np.asarray(fp8.scaled_mm(xq, x_scale, w, w_scale), np.float32)
        ref = np.asarray(cc.fp8_scaled_mm_reference(xq, x_scale, w, w_scale), np.float32)
        magnitude = (np.abs(np.asarray(xq, np.float32)) @ np.abs(np.asarray(w, np.float32)).T) * x_scale * w_scale
        # a GPU: one bf16 rounding (2^-7 of the value at most), and f32 sums of K terms in another order
        bound = (2.0 ** -7 * np.abs(ref) + 2.0 ** -12 * magnitude) if ON_GPU else 0.0
        assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (rows, k, m, np.abs(out - ref).max())
        with monkeypatch.context() as patch:
            patch.setattr(cc, "has_cublaslt", lambda: True)
            text = jax.jit(fp8.scaled_mm).trace(xq, x_scale, w, w_scale).lower(
                lowering_platforms=("cuda",)).as_text()
        calls = set(re.findall(r"custom_call @(jaxserve_fp8_\w+)", text))
        assert calls == {target}, (rows, k, m, calls)


def test_fp8_scaled_mm_reference_matches_f64():
    """The reference (what the GPU's cuBLASLt call must give) against float64 from the same e4m3 operands: f32
    summation over K of products exact in f32, then the bf16 rounding of the scaled result (2^-8 of itself). On a
    GPU XLA's FP8 GEMM accumulates with fewer bits (see test_fp8_scaled_mm_matches_f64)."""
    seed, rng = fresh_rng()
    x, w = random_values(rng, (7, 96), FP8), random_values(rng, (32, 96), FP8)
    x_scale = rng.uniform(0.5, 2.0, (7, 1)).astype(np.float32)
    w_scale = (rng.uniform(0.5, 2.0, 32) * 2.0 ** rng.integers(-12, 4, 32)).astype(np.float32)
    out = np.asarray(cc.fp8_scaled_mm_reference(x, x_scale, w, w_scale), np.float64)
    ref, bound = fp8_scaled_mm_bound(x, x_scale, w, w_scale, accumulation=2e-3 if ON_GPU else 98 * 2.0 ** -24)
    assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())


def fp8_scaled_mm_bound(x, x_scale, w, w_scale, accumulation: float):
    """(x w^T x_scale w_scale in f64, the error allowed in bf16 out): 2^-8 of itself (rounding to bf16, scales
    applied in f32) plus `accumulation` of sum |x w| x_scale w_scale (the GEMM's summation)."""
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    scales = np.asarray(x_scale, np.float64).reshape(-1, 1) * np.asarray(w_scale, np.float64)
    ref = (xd @ wd.T) * scales
    return ref, 2.0 ** -8 * np.abs(ref) + accumulation * (np.abs(xd) @ np.abs(wd).T) * scales


@needs_gpu
@pytest.mark.parametrize("rows, k", [(1, 576), (40, 4096), (300, 14336), (17, 1536), (2, 32768)])
def test_fp8_quantize_rows_gives_the_references_scales_and_the_nearest_e4m3(rows, k):
    """The CUDA quantize (a row in one CTA's registers) against XLA's reduction and conversion, its outputs'
    memory NaN-poisoned first: the same scales bit for bit, a zero row's included, and each element x / scale
    rounded to the nearest e4m3 (assert_nearest_e4m3: XLA's x * (1 / scale) may round an element lying on an e4m3
    tie, to an f32 ulp, the other way)."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x = fp8_rows(rng, rows, k)
    poison_device_memory((rows, k), FP8)
    poison_device_memory((rows, 1), jnp.float32)
    q, scale = jax.jit(cc.fp8_quantize_rows)(x)
    ref_q, ref_scale = jax.jit(cc.fp8_quantize_rows_reference)(x)
    assert_same_bits(scale, ref_scale, seed)
    assert_nearest_e4m3(q, np.asarray(x, np.float64) / np.asarray(scale, np.float64), seed)
    assert_nearest_e4m3(ref_q, np.asarray(x, np.float64) / np.asarray(scale, np.float64), seed)


def assert_nearest_e4m3(q, v, seed) -> None:
    """q is each of v (float64, within +-448) rounded to the nearest e4m3, or, where v lies within 2^-21 of halfway
    between two e4m3 values, either of them: a quotient made as x * (1 / scale) in f32 is that close to v (two
    roundings of 2^-24), and which way such a tie goes depends on them."""
    got = np.asarray(q, np.float64)
    near = [np.clip(v * (1 + d), -cc.FP8_MAX, cc.FP8_MAX).astype(FP8).astype(np.float64)
            for d in (-2.0 ** -21, 2.0 ** -21)]
    ok = np.isfinite(got) & ((got == near[0]) | (got == near[1]))
    assert ok.all(), (f"seed {seed}", np.argwhere(~ok)[:5], got[~ok][:5], v[~ok][:5])


def check_quantized_rows(q, scale, h, rounding: float, seed) -> None:
    """q [N, K] e4m3 and scale [N, 1] against the float64 rows h they quantize, made in bf16 within `rounding` of
    h: each scale within `rounding` of its row's amax / 448, each element within half an e4m3 step (2^-4 of itself,
    2^-10 of the scale for subnormals) plus `rounding` of itself."""
    scale = np.asarray(scale, np.float64)
    ref_scale = np.maximum(np.abs(h).max(axis=1, keepdims=True) / cc.FP8_MAX, cc.FP8_MIN_SCALE)
    np.testing.assert_allclose(scale, ref_scale, rtol=rounding, err_msg=f"seed {seed}")
    out = np.asarray(q, np.float64) * scale
    bound = (2.0 ** -4 + rounding) * np.abs(h) + 2.0 ** -9 * scale
    assert np.isfinite(out).all() and (np.abs(out - h) <= bound).all(), (f"seed {seed}", np.abs(out - h).max())


@needs_gpu
@pytest.mark.parametrize("rows, k", [(40, 14336), (3, 1536)])
def test_fp8_quantize_rows_of_the_silu_product_within_e4m3_rounding(rows, k):
    """silu(x) * up quantized in one read of x and up, against the product in float64: the kernel's product in f32
    rounded to bf16 once is within 2^-8 of it (plus f32's exp), so each row's scale is within 2^-7 of its amax /
    448 and each element within half an e4m3 step (2^-4 of itself, 2^-10 of the scale for subnormals) plus that.
    (XLA's bf16 product, rounded along the way, is further off: up to ~1% on an H200.)"""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x, up = fp8_rows(rng, rows, k), fp8_rows(rng, rows, k)
    poison_device_memory((rows, k), FP8)
    q, scale = jax.jit(cc.fp8_quantize_rows)(x, up)
    xd, ud = np.asarray(x, np.float64), np.asarray(up, np.float64)
    check_quantized_rows(q, scale, xd / (1.0 + np.exp(-xd)) * ud, 2.0 ** -7, seed)


@needs_gpu
@pytest.mark.parametrize("rows, k", [(40, 4096), (3, 576), (300, 2048)])
def test_fp8_quantize_rows_of_the_rms_norm_within_e4m3_rounding(rows, k):
    """RMSNorm(x) quantized in one read of x against the norm in float64: the kernel rounds x / rms to bf16 and its
    product with the weight to bf16 again (2^-8 each, the norm's own roundings; its sum of squares runs in another
    order than XLA's), so each row's scale is within 2^-6 of its amax / 448 and each element within half an e4m3
    step (2^-4 of itself, 2^-10 of the scale for subnormals) plus those."""
    assert cc.available(), cc.unavailable_reason()
    seed, rng = fresh_rng()
    x, eps = fp8_rows(rng, rows, k), 1e-5
    weight = jnp.asarray(rng.uniform(-2.0, 2.0, k), jnp.bfloat16)
    poison_device_memory((rows, k), FP8)
    q, scale = jax.jit(cc.fp8_rms_norm_quantize_rows, static_argnums=2)(x, weight, eps)
    xd = np.asarray(x, np.float64)
    h = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    check_quantized_rows(q, scale, h, 2.0 ** -6, seed)


@needs_gpu
@pytest.mark.parametrize("rows, k, m", [(17, 4096, 1024), (40, 576, 1536), (256, 14336, 4096), (4096, 4096, 256)])
def test_fp8_scaled_mm_matches_f64(rows, k, m):
    """cuBLASLt's FP8 GEMM with per-row and per-channel scales in its epilogue, over every e4m3 bit pattern, its
    output memory NaN-poisoned first. The FP8 tensor cores' fast accumulation keeps fewer mantissa bits than f32
    (an H100 measured up to 8e-4 of sum |x w| over K = 4096 and 14336): 2e-3 of it allowed."""
    assert cc.has_cublaslt(), "the CUDA library was built without cuBLASLt"
    seed, rng = fresh_rng()
    x, w = random_values(rng, (rows, k), FP8), random_values(rng, (m, k), FP8)
    x_scale = (rng.uniform(0.5, 2.0, (rows, 1)) * 2.0 ** rng.integers(-12, 4, (rows, 1))).astype(np.float32)
    w_scale = (rng.uniform(0.5, 2.0, m) * 2.0 ** rng.integers(-12, 4, m)).astype(np.float32)
    poison_device_memory((rows, m), jnp.bfloat16)
    out = np.asarray(jax.jit(cc.fp8_scaled_mm)(x, x_scale, w, w_scale), np.float64)
    ref, bound = fp8_scaled_mm_bound(x, x_scale, w, w_scale, accumulation=2e-3)
    assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (f"seed {seed}", np.abs(out - ref).max())
