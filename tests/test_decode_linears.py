"""bf16 decode linears through the CUDA kernel (llama.BF16_DECODE_KERNEL, custom_calls.bf16_linear): which launches a
decode step makes, where the kernel's FFI call is stood in for by its reference (CPU), and on one NVIDIA GPU the
model through the kernel against XLA's GEMMs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import custom_calls
from jaxserve import LLM, SamplingParams
from jaxserve.models import llama
from jaxserve.models.loader import random_model

from helpers import KNOBS, TINY, on_gpu

# every linear's N a multiple of 64 (the kernel's default tile): q 128, k and v 64, gate/up 256, LM head 128
MODEL = dataclasses.replace(TINY, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, head_dim=64)
ROWS = 16   # a decode bucket's


def hidden(loaded, ids):
    return nnx.jit(lambda m, ids: m(ids, jnp.arange(ids.shape[0]))[0])(loaded.model, ids)


@pytest.fixture
def recorded_launches(monkeypatch):
    """The kernel switched on as on one NVIDIA GPU, each launch recorded as (weights' shapes, given live rows) and
    run by the reference (as are the rotation written with the cache, the add with the norm after it and the copy
    of a step's sent bytes)."""
    launches = []

    def launch(x, weights, scales, *, launch, live=None, gated=False):
        assert scales is None and not gated and launch[0] >= 1
        launches.append((tuple(w.shape for w in weights), live is not None))
        return [custom_calls.bf16_linear_reference(x, w, live) for w in weights]

    monkeypatch.setattr(llama, "BF16_DECODE_KERNEL", True)
    monkeypatch.setattr(custom_calls, "available", lambda: True)
    monkeypatch.setattr(custom_calls, "sm_count", lambda: 132)
    monkeypatch.setattr(custom_calls, "call_decode_linear", launch)
    monkeypatch.setattr(custom_calls, "call_rope_and_cache", custom_calls.rope_and_cache_reference)
    monkeypatch.setattr(custom_calls, "call_add_rms_norm", custom_calls.add_rms_norm_reference)
    monkeypatch.setattr(custom_calls, "call_copy_outside_graphs", lambda x: x)
    return launches


def test_a_decode_step_launches_the_kernel_once_per_input(recorded_launches):
    """q/k/v one launch, o one, gate/up one, down one (a layer's trace, which every layer runs); the output is what
    XLA's GEMMs give."""
    loaded = random_model(MODEL, jnp.bfloat16)
    ids = jnp.arange(ROWS, dtype=jnp.int32) % MODEL.vocab_size
    llama.BF16_DECODE_KERNEL = False
    want = hidden(loaded, ids)
    assert not recorded_launches
    llama.BF16_DECODE_KERNEL = True
    jax.clear_caches()   # the switch is read when a step traces
    got = hidden(loaded, ids)
    h, q, kv, i = MODEL.hidden_size, MODEL.num_heads * 64, MODEL.num_kv_heads * 64, MODEL.intermediate_size
    layer = [((h, q), (h, kv), (h, kv)), ((q, h),), ((h, i), (h, i)), ((i, h),)]
    assert [shapes for shapes, _ in recorded_launches] == layer
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_the_launches_are_told_the_live_rows(recorded_launches):
    """A paged step's real rows reach every launch of the attention projections and the MLP."""
    loaded = random_model(MODEL, jnp.bfloat16)
    layer = loaded.model.layers[0]
    x = jnp.ones((ROWS, MODEL.hidden_size), jnp.bfloat16)
    live = jnp.int32(3)
    layer.self_attn.project(x, jnp.arange(ROWS), live)
    out = layer.mlp(x, live)
    assert len(recorded_launches) == 3 and all(told for _, told in recorded_launches)
    assert not np.asarray(out[3:], np.float32).any()


def test_more_rows_than_a_decode_step_stay_with_xla(recorded_launches):
    loaded = random_model(MODEL, jnp.bfloat16)
    hidden(loaded, jnp.zeros(custom_calls.DECODE_LINEAR_MAX_ROWS + 1, jnp.int32))
    assert not recorded_launches


def test_a_replica_on_one_device_of_a_larger_host_takes_the_kernel(recorded_launches, monkeypatch):
    """A data-parallel replica runs its steps on one device of a host with several: its mesh, not the host's
    device count, lets the kernel take its rows, in every graph the engine builds."""
    loaded = random_model(MODEL, jnp.bfloat16)
    monkeypatch.setattr(jax, "device_count", lambda *_: 2)
    jax.clear_caches()
    hidden(loaded, jnp.zeros(ROWS, jnp.int32))
    assert not recorded_launches   # traced under no mesh: the host's two devices
    llm = LLM(loaded, **KNOBS, num_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    h, q, kv = MODEL.hidden_size, MODEL.num_heads * 64, MODEL.num_kv_heads * 64
    # a decode step's q/k/v, fused on the replica's one device (llama.fuse_qkv), told its live rows
    assert (((h, q + 2 * kv),), True) in recorded_launches


@pytest.mark.skipif(not on_gpu() or jax.device_count() != 1, reason="the kernel runs on one NVIDIA GPU")
def test_the_model_through_the_kernel_gives_xlas_hidden_states(monkeypatch):
    """A Qwen3-30B-A3B-wide attention (hidden 2048, q 4096, k/v 512) and a dense MLP through the CUDA kernel against
    XLA's GEMMs, bf16: within bf16's rounding of the two summation orders."""
    cfg = dataclasses.replace(MODEL, hidden_size=2048, intermediate_size=768, num_heads=32, num_kv_heads=4,
                              head_dim=128, vocab_size=1024)
    loaded = random_model(cfg, jnp.bfloat16)
    ids = jnp.arange(ROWS, dtype=jnp.int32)
    want = hidden(loaded, ids)
    monkeypatch.setattr(llama, "BF16_DECODE_KERNEL", True)
    jax.clear_caches()
    got = hidden(loaded, ids)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
