"""FP8 linear layers: weights in float8 e4m3 with a scale per output channel. Steps of many rows run W8A8:
activations quantized per token at run time, one FP8 GEMM with an f32 result; on sm_89+ GPUs XLA lowers the dot of
two e4m3 operands to cuBLASLt's FP8 GEMM (custom call `__cublas$lt$matmul$f8`): half the weight bytes of bf16 and
twice its tensor-core rate. Decode steps run W8A16 (W8A16_MAX_ROWS): on one NVIDIA GPU through the CUDA kernel
custom_calls.fp8_linear, elsewhere through XLA (its reference)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import custom_calls
from jaxserve.cache.kv_cache import FP8_MAX

FP8 = jnp.float8_e4m3fn
# Steps of at most this many rows (decode) read the e4m3 weight into a bf16 GEMM (W8A16), the weight read once, as
# e4m3: such steps are bound by weight reads, and quantizing their activations costs kernels and accuracy. Larger
# steps run W8A8 on the FP8 tensor cores.
W8A16_MAX_ROWS = custom_calls.FP8_LINEAR_MAX_ROWS
# W8A16 through the CUDA kernel where it runs (benchmarks turn it off to time XLA's GEMM beside it)
W8A16_KERNEL = True
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
        x2 = x.reshape(-1, x.shape[-1])
        y = self.w8a16(x2) if x2.shape[0] <= W8A16_MAX_ROWS else self.w8a8(x2)
        y = y.astype(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias[...]

    def w8a8(self, x):
        """x [N, in] -> f32 [N, out]: both operands e4m3, never upcast (XLA turns that into the FP8 GEMM)."""
        xq, x_scale = quantize_rows(x)
        y = jax.lax.dot_general(xq, self.weight[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y * x_scale * self.weight_scale[...]

    def w8a16(self, x):
        """x [N, in] -> [N, out] in x's dtype, the weight widened to x's dtype inside the GEMM."""
        return linears_w8a16([self], x)[0]


def linears_w8a16(layers, x) -> list:
    """x [N, in] through Fp8Linear layers that read it (q, k, v; gate, up), W8A16, without their biases. On one
    NVIDIA GPU one launch of the CUDA kernel reads all their weights (custom_calls.fp8_linear: faster than XLA's
    fused GEMM, and a launch's fixed cost is paid once); it runs on one device only (a sharded weight would be
    gathered whole for it). Elsewhere XLA's GEMM for each."""
    ws, scales = [layer.weight[...] for layer in layers], [layer.weight_scale[...] for layer in layers]
    if (W8A16_KERNEL and jax.device_count() == 1 and not custom_calls.fp8_linear_unsupported(x, ws, scales)
            and custom_calls.available()):
        return custom_calls.fp8_linear(x, ws, scales)
    return [custom_calls.fp8_linear_reference(x, w, s) for w, s in zip(ws, scales)]


def fp8_linears(layers, x) -> list:
    """[layer(x) for layer in layers] for linear layers that read the same x; FP8 decode rows in one W8A16 launch
    (linears_w8a16)."""
    x2 = x.reshape(-1, x.shape[-1])
    if len(layers) == 1 or not all(isinstance(layer, Fp8Linear) for layer in layers) or \
            x2.shape[0] > W8A16_MAX_ROWS:
        return [layer(x) for layer in layers]
    ys = linears_w8a16(layers, x2)
    return [(y if layer.bias is None else y + layer.bias[...]).reshape(*x.shape[:-1], -1)
            for layer, y in zip(layers, ys)]
