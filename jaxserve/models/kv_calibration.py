"""Scales of an FP8 KV cache, per layer and kv head, measured on a calibration text at start-up.

A scale maps a head's largest |k| (or |v|) on the text to FP8_MAX / KV_SCALE_HEADROOM: serving may meet larger
values than the text holds, and e4m3 keeps the same relative precision at every magnitude, so the headroom costs
only its smallest binade, while a value past FP8_MAX would be clipped."""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.cache.kv_cache import FP8_MAX

CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"
CALIBRATION_TOKENS = 512
KV_SCALE_HEADROOM = 2.0
MIN_AMAX = 1e-6   # a head that is all zeros on the text still gets a usable scale


def calibration_ids(tokenizer, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> np.ndarray:
    """The calibration text's first num_tokens tokens; random ids for a model without a tokenizer (benchmarks'
    random weights, which have no language either)."""
    if tokenizer is None:
        return np.random.default_rng(0).integers(0, vocab_size, num_tokens, dtype=np.int32)
    ids = tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)
    return np.asarray(ids[:num_tokens], np.int32)


@functools.partial(jax.jit, static_argnames="graphdef")
def _layer_kv_amax(graphdef, state, x, positions):
    """One decoder layer's output and its k, v amax per kv head; the layers share a structure, one trace."""
    layer = nnx.merge(graphdef, state)
    _, k, v = layer.self_attn.project(layer.input_layernorm(x), positions)
    amax = lambda t: jnp.max(jnp.abs(t.astype(jnp.float32)), axis=(0, 2))
    x, delta, _ = layer(x, jnp.zeros_like(x), positions, None, None)
    return x + delta, amax(k), amax(v)


def calibrate_kv_scales(model, token_ids: np.ndarray) -> None:
    """Set every layer's k_scale and v_scale (replicated on the model's mesh) from the dense forward over
    token_ids."""
    ids = jnp.asarray(token_ids, jnp.int32)
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    x = model.embed_tokens(ids)
    replicated = NamedSharding(model.embed_tokens.embedding[...].sharding.mesh, P())
    for layer in model.layers:
        graphdef, state = nnx.split(layer)
        x, k_amax, v_amax = _layer_kv_amax(graphdef, state, x, positions)
        attn = layer.self_attn
        for var, amax in ((attn.k_scale, k_amax), (attn.v_scale, v_amax)):
            scale = jnp.maximum(amax, MIN_AMAX) * KV_SCALE_HEADROOM / FP8_MAX
            var.set_value(jax.device_put(scale, replicated))
