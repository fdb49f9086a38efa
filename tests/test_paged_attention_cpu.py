"""The CPU attention kernel (custom_calls/paged_attention_cpu.py) against float64 numpy and the pure-JAX reference.

The batches are the Pallas kernels' (helpers.make_batch): NaN in every cache slot no live token wrote, garbage in
block-table entries past a sequence's end and in kv_lens past num_seqs, so a read of anything unwritten shows as NaN,
and padding rows must come out exactly zero. The kernel computes in f32 as the reference does, in another order:
TOLERANCE's 1e-5 of the largest output (f32 sums of <= 250 products) and 2e-2 for bf16 outputs (one rounding).
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_calls import cpu as cpu_calls, paged_attention_cpu
from jaxserve import LLM, SamplingParams
from pallas_kernels.cascade_attention import CascadeGroups, cascade_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_impl
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

from helpers import GEOMETRY, MIXES, cached_as, check_close, make_batch, naive_attention

pytestmark = pytest.mark.skipif(not cpu_calls.available(), reason="the CPU custom calls run on an x86-64 CPU with "
                                "AVX2, FMA and F16C and a C++ compiler, under JAX's CPU backend")
FP8 = jnp.float8_e4m3fn


def as_bits(batch):
    """The batch's fp8 cache as the engine keeps one on a CPU: its bits, uint8."""
    bits = lambda c: jax.lax.bitcast_convert_type(c, jnp.uint8)  # noqa: E731
    return dataclasses.replace(batch, k_cache=bits(batch.k_cache), v_cache=bits(batch.v_cache))


def run_cpu(batch, **options):
    return ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="cpu", **options)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20}, {"soft_cap": 5.0}])
@pytest.mark.parametrize("dtype, cache", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, FP8),
                                          (jnp.bfloat16, FP8)])
def test_matches_float64(mix, options, dtype, cache):
    batch = cached_as(make_batch(np.random.default_rng(0), *MIXES[mix], **GEOMETRY, dtype=dtype), cache)
    check_close(run_cpu(batch, **options), naive_attention(batch, sm_scale=0.125, **options), batch, dtype, mix)


def test_fp8_bits_read_as_e4m3():
    """A cache of e4m3 bits (uint8) gives exactly what the same cache as float8_e4m3fn gives."""
    batch = cached_as(make_batch(np.random.default_rng(1), *MIXES["mixed"], **GEOMETRY), FP8)
    as_e4m3 = run_cpu(batch, sliding_window=33)
    check_close(as_e4m3, naive_attention(batch, sm_scale=0.125, sliding_window=33), batch, jnp.float32)
    np.testing.assert_array_equal(np.asarray(run_cpu(as_bits(batch), sliding_window=33)), np.asarray(as_e4m3))


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size", [
    (2, 2, 128, 16),  # one q head a kv head
    (6, 2, 64, 8),    # three
    (8, 1, 64, 32),   # eight, one kv head
    (4, 4, 8, 1),     # the smallest head_dim and block
    (9, 3, 256, 4),   # SmolLM2's group of three, a wide head
])
def test_gqa_and_shapes(q_heads, kv_heads, head_dim, block_size):
    shape = {**GEOMETRY, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
             "max_blocks": 128 // block_size, "num_blocks": 320 // block_size + 8}
    batch = make_batch(np.random.default_rng(2), *MIXES["mixed"], **shape)
    check_close(run_cpu(batch), naive_attention(batch, sm_scale=0.125), batch, jnp.float32)


def test_random_mixes_against_the_reference():
    rng = np.random.default_rng(3)
    for i in range(8):
        q_lens = [1] * int(rng.integers(0, 5)) + [int(n) for n in rng.integers(2, 17, rng.integers(0, 3))]
        q_lens = q_lens or [int(rng.integers(1, 33))]
        kv_lens = [q + int(rng.integers(0, 128 - q)) for q in q_lens]
        batch = make_batch(rng, q_lens, kv_lens, **GEOMETRY)
        options = {"sliding_window": int(rng.integers(1, 64))} if i % 2 else {"soft_cap": 3.0}
        expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
        check_close(run_cpu(batch, **options), expected, batch, jnp.float32, f"{q_lens} {kv_lens} {options}")


def test_work_split_over_threads():
    """A batch of more key reads than a call keeps on its own thread (two 256-token prefills and decodes over 500
    keys): the work is shared out over XLA's threads, and every row is still its own."""
    shape = {**GEOMETRY, "num_tokens": 528, "max_blocks": 32, "num_blocks": 128, "kv_heads": 4}
    batch = make_batch(np.random.default_rng(4), [1, 1, 256, 256, 14], [500, 3, 256, 300, 490], **shape)
    check_close(run_cpu(batch), naive_attention(batch, sm_scale=0.125), batch, jnp.float32)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 300}, {"soft_cap": 5.0}])
def test_a_long_decode_is_split_into_spans_that_merge(options):
    """One decode over 1,000 keys (a batch-1 step late in a long answer) is cut into spans of the kernel's 256 keys
    that the threads share, a span's first key inside a block of 24, and their softmax states merged: the output
    is the whole softmax's. Beside it a short decode stays one span."""
    shape = {**GEOMETRY, "block_size": 24, "max_blocks": 42, "num_blocks": 96, "kv_heads": 3, "q_heads": 9}
    batch = make_batch(np.random.default_rng(5), [1, 1], [1000, 30], **shape)
    check_close(run_cpu(batch, **options), naive_attention(batch, sm_scale=0.125, **options), batch, jnp.float32)


@pytest.mark.parametrize("change", ["num_seqs past the rows", "cu_q_lens past the tokens", "kv_lens below q_lens",
                                    "block ids out of range"])
def test_malformed_metadata_stays_in_bounds(change):
    """Metadata the engine never sends is clamped, never read through: the call returns finite rows (zeros where a
    token has no keys) instead of reading outside the buffers."""
    batch = make_batch(np.random.default_rng(5), *MIXES["mixed"], **GEOMETRY)
    batch = dataclasses.replace(batch, k_cache=jnp.nan_to_num(batch.k_cache), v_cache=jnp.nan_to_num(batch.v_cache))
    cu, lens, tables = (np.array(x) for x in (batch.cu_q_lens, batch.kv_lens, batch.block_tables))
    bad = {
        "num_seqs past the rows": dict(num_seqs=jnp.asarray([1 << 20], jnp.int32)),
        "cu_q_lens past the tokens": dict(cu_q_lens=jnp.asarray(cu * 1000)),
        "kv_lens below q_lens": dict(kv_lens=jnp.asarray(np.where(lens > 1 << 19, lens, -lens))),
        "block ids out of range": dict(block_tables=jnp.asarray(tables * -7919 + (1 << 30))),
    }[change]
    out = np.asarray(run_cpu(dataclasses.replace(batch, **bad)))
    assert np.isfinite(out).all()


def test_auto_takes_the_kernel_on_a_cpu_and_refusals_name_the_way_out():
    assert resolve_impl("auto", False, jnp.float32, 64) == "cpu"
    assert resolve_impl("auto", False, jnp.uint8, 64) == "cpu"   # an fp8 cache's bits, as the engine keeps one
    assert resolve_impl("auto", False, jnp.float32, 60) == "reference"
    batch = make_batch(np.random.default_rng(6), *MIXES["decodes"], **{**GEOMETRY, "head_dim": 4})
    with pytest.raises(ValueError, match="impl='cpu' cannot serve this call: head_dim must be a multiple of 8"):
        run_cpu(batch)
    check_close(ragged_paged_attention(*batch.args(), sm_scale=0.125), naive_attention(batch, sm_scale=0.125), batch,
                jnp.float32)
    groups = CascadeGroups(*(jnp.zeros(n, jnp.int32) for n in (8, 8, 2, 1, 1, 1)))
    with pytest.raises(ValueError, match="cascade attention has no CPU kernel"):
        cascade_attention(batch.q[:8], batch.k_cache, batch.v_cache, batch.kv_lens, batch.block_tables, batch.num_seqs,
                          groups, sm_scale=0.125, impl="cpu")


@pytest.mark.slow
def test_engine_attends_through_the_kernel(smollm, monkeypatch, tmp_path, without_xla_cache):
    """The engine's CPU steps (chunked prefills beside decodes) call the kernel, and give the tokens and logprobs the
    pure-JAX reference gives (logprobs to 1e-4: f32 sums in another order move them ~1e-6). An engine where the
    kernel cannot run does not load the executables that call it from a shared compile cache (each graph compiled
    here, as in a jaxserve process on a CPU, so the first engine keeps them there): it traces the reference."""
    rpa = sys.modules[ragged_paged_attention.__module__]   # the package's name for it is the function's
    calls = {"cpu": 0, "reference": 0}

    def counting(name, run):
        def counted(*args, **kwargs):
            calls[name] += 1
            return run(*args, **kwargs)
        return counted
    monkeypatch.setattr(paged_attention_cpu, "ragged_paged_attention_cpu",
                        counting("cpu", paged_attention_cpu.ragged_paged_attention_cpu))
    monkeypatch.setattr(rpa, "ragged_paged_attention_reference",
                        counting("reference", ragged_paged_attention_reference))
    prompts = [list(range(100, 100 + n)) for n in (37, 5, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=32, min_prefill_chunk=8, max_model_len=256, num_blocks=64,
                 precompile=False, compile_cache_dir=str(tmp_path))

    def generate():   # jax's memo of traced steps forgotten: the library's state is not a static argument
        jax.clear_caches()
        return [o.outputs[0] for o in LLM(smollm, **knobs).generate(prompts, params)]
    with_kernel = generate()
    assert calls["cpu"] and not calls["reference"], f"the engine's steps did not trace the CPU kernel alone: {calls}"
    monkeypatch.setattr(paged_attention_cpu, "unsupported", lambda *a: "off for this test")
    calls.update(cpu=0)
    with_reference = generate()
    assert calls["reference"] and not calls["cpu"], f"the kernel's executables were loaded where it is off: {calls}"
    for ours, expected in zip(with_kernel, with_reference):
        assert ours.token_ids == expected.token_ids
        np.testing.assert_allclose([lp[t] for t, lp in zip(ours.token_ids, ours.logprobs)],
                                   [lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)], atol=1e-4)
