"""FP8 linear layers (W8A8): weights in float8 e4m3 with a scale per output channel, activations quantized per
token at run time, one FP8 GEMM with an f32 result. On sm_89+ GPUs XLA lowers the dot of two e4m3 operands to
cuBLASLt's FP8 GEMM (custom call `__cublas$lt$matmul$f8`): half the weight bytes of bf16 and twice its
tensor-core rate."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.cache.kv_cache import FP8_MAX

FP8 = jnp.float8_e4m3fn
# The smallest normal f32: an all-zero row (padding tokens, a pruned channel) gets a finite scale and quantizes to
# zeros, and no other row's scale (its amax / FP8_MAX) is this small
MIN_SCALE = float(np.finfo(np.float32).tiny)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, K] -> (e4m3 [N, K], f32 scale [N, 1]) with x ~ q * scale: each row's amax maps to FP8_MAX. Clipped
    before the cast: e4m3fn has no infinity, an overflowing conversion is NaN, and amax / scale can round past
    FP8_MAX."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX, MIN_SCALE)
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def quantize_weight(w: jax.Array, out_axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """A float weight [out, in] (out_axis=0, as checkpoints store it) or [in, out] (out_axis=1, nnx.Linear's
    kernel) -> (e4m3 [out, in], f32 scale [out]), a scale per output channel."""
    q, scale = quantize_rows(w if out_axis == 0 else w.T)
    return q, scale[:, 0]


def dequantize_blocks(w: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """e4m3 w [out, in] with a scale per block of block[0] x block[1] (scale [ceil(out / b0), ceil(in / b1)], the
    edge blocks partial) -> f32 [out, in]."""
    out, inp = w.shape
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=0)[:out], block[1], axis=1)[:, :inp]
    return w.astype(jnp.float32) * full


class Fp8Linear(nnx.Module):
    """y = x W^T + b with W in e4m3. The weight is stored [out, in], K-contiguous like the activations: the layout
    cuBLASLt's FP8 GEMM takes (both operands K-major), so XLA inserts no transpose at run time."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype, rngs: nnx.Rngs):
        kernel = nnx.initializers.lecun_normal()(rngs.params(), (in_features, out_features))  # nnx.Linear's init
        weight, scale = quantize_weight(kernel, out_axis=1)
        self.weight = nnx.Param(weight)
        self.weight_scale = nnx.Param(scale)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x):
        """x [..., in] -> [..., out] in x's dtype."""
        xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        # both operands e4m3, never upcast: that is what XLA turns into the FP8 GEMM
        y = jax.lax.dot_general(xq, self.weight[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        y = (y * x_scale * self.weight_scale[...]).astype(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias[...]
