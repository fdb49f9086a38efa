"""The Mosaic GPU decode kernel against the reference: interpreted on the CPU (Mosaic GPU's warpgroup interpreter),
compiled on an H100/H200.

Batches as in test_ragged_paged_attention: NaN in every cache slot no live token wrote, garbage block-table entries
past each sequence's end and garbage lengths past num_seqs, so a key read past a context, an unmasked tail or an
unwritten output row shows up as NaN. Every call goes through `ragged_paged_attention(decode_only=True,
decode_backend="mosaic")`, the engine's entry point.
"""
import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode_attention_mgpu as mgpu_decode
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference

from helpers import (GEOMETRY, MIXES, cached_as, check_close, make_batch, on_gpu, on_hopper, poison_allocator,
                     without_triton)

ON_GPU = on_gpu()
FP8 = jnp.float8_e4m3fn
pytestmark = pytest.mark.skipif(ON_GPU and not on_hopper(), reason="the Mosaic GPU decode kernel needs sm_90")
# Interpreted, the persistent grid has 4 CTAs (no core count): each walks several work items, so the pipeline's
# barriers carry their phases from one item into the next.
SPLIT = {"mosaic_decode_programs": 64}  # 8 decode slots x 2 kv heads: 4 splits of each context, 64 items
WHOLE = {"mosaic_decode_programs": 2}  # one item per (decode, kv head)


def check_decode(batch, tuning, label, **options):
    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
    poison_allocator(batch)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=not ON_GPU,
                                 decode_only=True, decode_backend="mosaic", **options, **tuning)
    check_close(out, expected, batch, jnp.bfloat16, label)  # float16 is held to bfloat16's (looser) tolerance


@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("tuning, options, cache", [
    (SPLIT, {"sliding_window": 33}, None),  # splits merged after the launch; a window starting inside a step
    (WHOLE, {}, None),  # one item a context: the output written by the kernel itself
    (SPLIT, {}, FP8),  # e4m3 tiles converted to float16 for wgmma
    (WHOLE, {}, FP8),  # over fp8, the output written by the kernel itself
])
@pytest.mark.parametrize("few_ctas", [False, True])
def test_decode_matches_reference(tuning, options, cache, warpgroups, few_ctas, monkeypatch):
    """Contexts of 1 key, one page, a page and one key, a whole 64-key step, several steps with a ragged tail;
    a row past the decodes (token 7) and padding tokens past the sequence slots come out zeros. An fp8 cache is
    checked against the reference over the same cache: e4m3 values are exact in float16, so bf16 q's tolerance holds.
    Two compute warpgroups take alternate steps (an odd count leaves the second one fewer, a 1-step context none)
    and merge. few_ctas: on the GPU, 4 CTAs as interpreted, so each walks several items, as at the engine's
    large batches (one CTA per SM takes every item of these small batches alone)."""
    if few_ctas:
        if not ON_GPU:
            pytest.skip("interpreted, every case already runs 4 CTAs of several items each")
        kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")
        on_mosaic = kernels.decode_on_mosaic
        monkeypatch.setattr(kernels, "decode_on_mosaic",
                            lambda *a, **k: dataclasses.replace(on_mosaic(*a, **k), num_ctas=4))
    shape = {**GEOMETRY, "num_tokens": 16, "max_blocks": 16}
    batch = cached_as(make_batch(np.random.default_rng(5), [1] * 7, [1, 16, 17, 64, 99, 250, 3], **shape,
                                 dtype=jnp.bfloat16), cache)
    check_decode(batch, {**tuning, "mosaic_decode_warpgroups": warpgroups}, f"{tuning} {cache} {warpgroups}",
                 **options)


@pytest.mark.slow
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size, dtype, options", [
    (9, 3, 64, 16, jnp.bfloat16, {"soft_cap": 5.0}),  # SmolLM2's GQA 3: a q slab of 3 rows; logit soft cap
    (8, 1, 128, 32, jnp.float16, {}),  # GQA 8, head_dim 128, 32-key pages
    (4, 4, 64, 64, jnp.bfloat16, {"sliding_window": 70}),  # no GQA; one page a step; window across steps
])
def test_decode_shapes(q_heads, kv_heads, head_dim, block_size, dtype, options):
    shape = {**GEOMETRY, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
             "num_tokens": 8, "max_seqs": 4, "max_blocks": 10, "num_blocks": 40}
    batch = make_batch(np.random.default_rng(6), [1] * 3, [5, 130, 64], **shape, dtype=dtype)
    for tuning in (SPLIT, WHOLE):
        check_decode(batch, tuning, str(tuning), **options)


@pytest.mark.parametrize("dtype, head_dim, reason", [
    (jnp.float32, 64, "dtype float32"),
    (jnp.bfloat16, 32, "head_dim 32"),
])
def test_mosaic_decode_refuses_what_it_cannot_serve(dtype, head_dim, reason):
    """Asked for by name it refuses with the reason and names the Triton kernel, which "auto" takes for such calls."""
    shape = {**GEOMETRY, "head_dim": head_dim}
    batch = make_batch(np.random.default_rng(7), [1] * 3, [5, 20, 40], **shape, dtype=dtype)
    with pytest.raises(ValueError, match=f"decode_backend='mosaic'.*{reason}.*decode_backend='triton'"):
        ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=not ON_GPU,
                               decode_only=True, decode_backend="mosaic")


def test_splits_follow_the_shape():
    """A small batch splits its contexts to fill the launch, a full one does not, and never past max_splits."""
    tuning = mgpu_decode.DecodeTuning(programs=132, max_splits=16)
    assert mgpu_decode.num_splits(8, 8, tuning) == 2
    assert mgpu_decode.num_splits(256, 8, tuning) == 1
    assert mgpu_decode.num_splits(1, 8, tuning) == 16


class FakeHopper:
    platform, compute_capability, core_count = "gpu", "9.0", 132


class FakeAmpere:
    platform, compute_capability, core_count = "gpu", "8.0", 108


@pytest.mark.parametrize("device, rows, backend, cache, picked", [
    (FakeHopper, 16, "auto", None, True),  # on Hopper "auto" is Mosaic GPU's, one CTA per SM
    (FakeHopper, 256, "auto", None, True),  # at any batch
    (FakeHopper, 16, "auto", FP8, True),  # over fp8 too (the engine's CUDA call takes an fp8 cache's decodes first)
    (FakeHopper, 16, "triton", None, False),  # Triton's only by name
    (FakeAmpere, 16, "auto", None, False),  # off Hopper: Triton's
    (FakeAmpere, 256, "mosaic", None, True),  # asked for by name: not refused here (the kernel's lowering is)
])
def test_which_decode_kernel_serves(monkeypatch, device, rows, backend, cache, picked):
    import jax
    kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")  # the package exports its function
    monkeypatch.setattr(jax, "devices", lambda *_: [device()])
    q = jnp.zeros((rows, 8, 64), jnp.bfloat16)
    k_cache = jnp.zeros((4, 16, 2, 64), cache or jnp.bfloat16)
    tuning = kernels.decode_on_mosaic(q, k_cache, kernels.Tuning(), backend, interpret=False)
    assert (tuning is not None) == picked
    if picked:
        assert tuning.num_ctas == device.core_count


@pytest.mark.parametrize("device, tokens, backend, cache, picked", [
    (FakeHopper, 64, "auto", None, True),  # on Hopper "auto" is Mosaic GPU's
    (FakeHopper, 64, "auto", FP8, True),  # over fp8 too
    (FakeHopper, 4, "auto", None, True),  # decode-like shapes too
    (FakeHopper, 64, "triton", FP8, False),  # Triton's only by name
    (FakeAmpere, 64, "auto", None, False),  # off Hopper: Triton's
    (FakeHopper, 4, "mosaic", None, True),
])
def test_which_prefill_kernel_serves(monkeypatch, device, tokens, backend, cache, picked):
    import jax
    kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")
    monkeypatch.setattr(jax, "devices", lambda *_: [device()])
    q = jnp.zeros((tokens, 8, 64), jnp.bfloat16)
    k_cache = jnp.zeros((4, 16, 2, 64), cache or jnp.bfloat16)
    scores = kernels.Scores(sm_scale=0.125, sliding_window=None, soft_cap=None)
    tuning = kernels.prefill_on_mosaic(q, k_cache, scores, kernels.Tuning(), backend, interpret=False)
    assert (tuning is not None) == picked
    if picked:
        assert tuning.num_ctas == device.core_count


def test_mixed_call_leaves_its_leading_decodes_to_decode_rows():
    """decode_rows serves a mixed call's leading decodes (three here) where the Mosaic prefill serves the rest: their
    rows are its output (a marker here, so a row the prefill kernel wrote instead shows), the others the prefill
    kernel's against the reference, padding tokens zero."""
    shape = {**GEOMETRY, "num_tokens": 96, "max_blocks": 16, "num_blocks": 64}
    batch = make_batch(np.random.default_rng(9), [1, 1, 1, 30, 41], [33, 5, 80, 71, 41], **shape, dtype=jnp.bfloat16)
    calls = []

    def decode_rows(q_rows, num_decodes):
        calls.append(q_rows.shape)
        live = jnp.arange(q_rows.shape[0]) < num_decodes
        return jnp.where(live[:, None, None], jnp.full_like(q_rows, 7.0), 0.0)

    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125)
    poison_allocator(batch)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=not ON_GPU,
                                 prefill_backend="mosaic", mosaic_block_kv=64, decode_rows=decode_rows)
    assert calls == [(GEOMETRY["max_seqs"], *batch.q.shape[1:])]
    np.testing.assert_array_equal(np.asarray(out[:3], np.float32), 7.0)
    check_close(out[3:], expected[3:], dataclasses.replace(batch, live_tokens=batch.live_tokens - 3), jnp.bfloat16,
                "prefill rows")


@pytest.mark.parametrize("options", [{}, {"sliding_window": 37}])
def test_mixed_batch_on_mosaic_alone(options):
    """Both backends "mosaic": the prefill kernel's rows, the decode kernel's rows written over the leading decodes
    (three here, then a chunk over cached context and a prompt), padding tokens zero."""
    shape = {**GEOMETRY, "num_tokens": 96, "max_blocks": 16, "num_blocks": 64}
    batch = make_batch(np.random.default_rng(8), [1, 1, 1, 30, 41], [33, 5, 80, 71, 41], **shape, dtype=jnp.bfloat16)
    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125, **options)
    poison_allocator(batch)
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=not ON_GPU,
                                 prefill_backend="mosaic", decode_backend="mosaic", mosaic_block_kv=64, **options,
                                 **SPLIT)
    check_close(out, expected, batch, jnp.bfloat16, str(options))


def test_leading_decodes():
    kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")
    cu = jnp.asarray([0, 1, 2, 5, 6, 6, 6], jnp.int32)  # q_lens 1, 1, 3, 1: the third ends the run
    assert int(kernels.leading_decodes(cu, 4)) == 2
    assert int(kernels.leading_decodes(cu, 1)) == 1
    assert int(kernels.leading_decodes(jnp.asarray([0, 4, 5, 5], jnp.int32), 2)) == 0


@pytest.mark.parametrize("decode_only, cache, soft_cap", [(True, jnp.bfloat16, None), (False, jnp.bfloat16, None),
                                                     (False, jnp.bfloat16, 5.0), (True, FP8, None),
                                                     (False, FP8, None)])
def test_both_backends_mosaic_launch_no_triton_kernel(decode_only, cache, soft_cap):
    """Lowered for an NVIDIA GPU (here without one), decode-only and mixed steps with both backends "mosaic" hold
    Mosaic GPU kernels only: a Triton kernel would show as its own custom call (or, with no GPU here, fail to
    lower at all); and the XLA around them is what XLA's GPU compiler takes. Lowering runs Mosaic GPU's layout
    inference, which the interpreter skips: a register layout it cannot find fails here, not only on a GPU."""
    import functools
    import re

    import jax
    shapes = [((64, 8, 64), jnp.bfloat16), ((64, 16, 2, 64), cache), ((64, 16, 2, 64), cache),
              ((9,), jnp.int32), ((8,), jnp.int32), ((8, 16), jnp.int32), ((1,), jnp.int32)]
    attend = functools.partial(ragged_paged_attention, sm_scale=0.125, impl="pallas", prefill_backend="mosaic",
                               decode_backend="mosaic", decode_only=decode_only, soft_cap=soft_cap)
    text = jax.jit(attend).trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
    # the decode rows join the prefill kernel's output by a select: XLA's GPU compiler refuses the
    # dynamic-update-slice fusion that an update of a custom call's output becomes (it failed to compile on the H200)
    assert "scatter" not in text and "dynamic_update_slice" not in text


def test_without_triton_auto_takes_mosaic_on_hopper_and_no_pallas_kernel_elsewhere(monkeypatch):
    """Under a JAX without Triton's backend, "auto" on Hopper takes the Mosaic GPU kernels as with it; off Hopper no
    Pallas kernel runs; "triton" named in the engine's knobs is refused."""
    import jax
    kernels = importlib.import_module("pallas_kernels.ragged_paged_attention")
    without_triton(monkeypatch)
    monkeypatch.setattr(jax, "devices", lambda *_: [FakeHopper()])
    tuning, q = kernels.Tuning(), jnp.zeros((256, 8, 64), jnp.bfloat16)
    for cache in (jnp.bfloat16, FP8):
        assert kernels.decode_on_mosaic(q, jnp.zeros((4, 16, 2, 64), cache), tuning, "auto", False) is not None
    scores = kernels.Scores(0.125, None, None)
    assert kernels.prefill_on_mosaic(q, jnp.zeros((4, 16, 2, 64), jnp.bfloat16), scores, tuning, "auto",
                                     False) is not None
    assert kernels.resolve_impl("auto", False, head_dim=64) == "pallas"
    monkeypatch.setattr(jax, "devices", lambda *_: [FakeAmpere()])
    assert kernels.resolve_impl("auto", False, head_dim=64) != "pallas"
    from jaxserve.models.attention import resolve_attention_kernels   # the engine's knobs name it too
    with pytest.raises(ValueError, match="prefill_attention='triton' but this JAX ships no Pallas Triton backend"):
        resolve_attention_kernels("auto", "triton", 64)


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("cache", [jnp.bfloat16, FP8])
@pytest.mark.parametrize("decode_only", [True, False])
def test_auto_steps_on_hopper_lower_to_mosaic_kernels_only(monkeypatch, decode_only, cache, triton):
    """Lowered for an NVIDIA GPU on Hopper, "auto" (impl and both backends) builds Mosaic GPU kernels only, with
    Triton's backend in this JAX or without it: a 64-row decode batch and a decode-like mixed step (as many tokens
    as sequences), over bf16 and fp8 caches; two layers' calls in one step lower each kernel once."""
    import functools
    import re

    import jax
    if not triton:
        without_triton(monkeypatch)
    monkeypatch.setattr(jax, "devices", lambda *_: [FakeHopper()])
    shapes = [((64, 8, 64), jnp.bfloat16), ((64, 16, 2, 64), cache), ((64, 16, 2, 64), cache),
              ((65,), jnp.int32), ((64,), jnp.int32), ((64, 16), jnp.int32), ((1,), jnp.int32)]
    attend = functools.partial(ragged_paged_attention, sm_scale=0.125, decode_only=decode_only)
    layers = jax.jit(lambda q, *rest: attend(q, *rest) + attend(2 * q, *rest))   # a step's layers
    text = layers.trace(*(jax.ShapeDtypeStruct(*s) for s in shapes)).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}
    assert text.count("custom_call @mosaic_gpu_v2") == (1 if decode_only else 2)


@pytest.mark.parametrize("mix", ["decodes", "mixed"])
def test_without_triton_the_reference_serves_what_triton_did(monkeypatch, mix):
    """Interpreted here (no Hopper), "auto" leaves these launches to Triton: under a JAX without its backend the
    reference serves them (a Triton launch would fail on the missing module); "triton" by name is refused."""
    without_triton(monkeypatch)
    batch = make_batch(np.random.default_rng(5), *MIXES[mix], **GEOMETRY)
    decode_only = mix == "decodes"
    out = ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=True, decode_only=decode_only)
    expected = ragged_paged_attention_reference(*batch.args(), sm_scale=0.125)
    live = np.asarray(out[:batch.live_tokens])
    assert not np.isnan(live).any()
    np.testing.assert_array_equal(live, np.asarray(expected[:batch.live_tokens]))
    backend = "decode_backend" if decode_only else "prefill_backend"
    with pytest.raises(ValueError, match=f"{backend}='triton' but this JAX ships no Pallas Triton backend"):
        ragged_paged_attention(*batch.args(), sm_scale=0.125, impl="pallas", interpret=True, decode_only=decode_only,
                               **{backend: "triton"})


@pytest.mark.skipif(ON_GPU, reason="the CPU engine's tokens are the reference: on a GPU the subprocess would need "
                                   "the device this process holds")
def test_the_engine_imports_and_serves_without_the_triton_module():
    """A JAX without `jax.experimental.pallas.triton` (the import fails) still imports jaxserve and serves: the tiny
    model's greedy tokens in a subprocess where the module cannot be imported equal this process's."""
    import subprocess
    import sys
    import textwrap

    from jaxserve import LLM, SamplingParams
    from jaxserve.models.loader import random_model
    from helpers import KNOBS, TINY
    script = textwrap.dedent("""
        import sys
        sys.modules["jax.experimental.pallas.triton"] = None   # `import` of it raises ImportError
        sys.path.insert(0, "tests")
        import jax.numpy as jnp
        from jaxserve import LLM, SamplingParams
        from jaxserve.models.loader import random_model
        from pallas_kernels.ragged_paged_attention import TRITON
        from helpers import KNOBS, TINY
        llm = LLM(random_model(TINY, jnp.float32), **KNOBS)
        out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        print(TRITON, out[0].outputs[0].token_ids)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    llm = LLM(random_model(TINY, jnp.float32), **KNOBS)
    here = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert run.stdout.strip().splitlines()[-1] == f"False {list(here)}"
