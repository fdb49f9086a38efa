"""FP8 linear layers: weights in float8 e4m3 with a scale per output channel. Steps of many rows run W8A8:
activations quantized per token at run time, one FP8 GEMM on the tensor cores (half the weight bytes of bf16 and
twice its rate): on one NVIDIA GPU through CUDA calls (custom_calls.fp8_quantize_rows, which makes the RMS norm or
the SiLU product it quantizes, and fp8_scaled_mm, cuBLASLt's FP8 GEMM with both scales in its epilogue, or fp8_mm
for a GEMM of few output tiles: UNSCALED_GEMM_MAX_TILES), elsewhere through XLA (on sm_89+ GPUs its
`__cublas$lt$matmul$f8` with an f32 result, scaled by a fusion after it). Decode steps run W8A16 (W8A16_MAX_ROWS):
on one NVIDIA GPU through the CUDA kernel custom_calls.fp8_linear, elsewhere through XLA (its reference)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

import custom_calls
from jaxserve.sharding import on_one_device

FP8 = jnp.float8_e4m3fn
# Steps of at most this many rows (decode) read the e4m3 weight into a bf16 GEMM (W8A16), the weight read once, as
# e4m3: such steps are bound by weight reads, and quantizing their activations costs kernels and accuracy. Larger
# steps run W8A8 on the FP8 tensor cores.
W8A16_MAX_ROWS = custom_calls.DECODE_LINEAR_MAX_ROWS
# W8A16 and W8A8 through the CUDA kernels where they run (benchmarks turn them off to time XLA's GEMMs beside them)
W8A16_KERNEL = True
W8A8_KERNELS = True
# W8A8 GEMMs whose output is at most this many 128 x 128 tiles (GEMM_TILE) run through custom_calls.fp8_mm, the
# scales in a fusion after it, not fp8_scaled_mm: cuBLASLt has one algorithm for outer-vector scales, 128 x 128 tiles
# and no split of K, so each of a few tiles runs the whole K while most SMs idle; the bare product's algorithms split
# K. Llama-3-8B on an H200 (benchmarks/fp8_w8a8_gemms.py, the scales included; fp8_w8a8_gemm_gpu.json, s62-call7):
# at 64 rows o 13.3 -> 9.4 us (32 tiles), q/k/v 13.8 -> 11.0 (48), down 36.7 -> 23.3 (32); at 256 rows o 13.7 ->
# 12.6 and down 37.6 -> 28.3 (64 each), while q/k/v (96 tiles) 14.6 against 15.5 and gate at 64 rows (112) 20.9
# against 21.6 keep the scales in the epilogue.
UNSCALED_GEMM_MAX_TILES = 64
GEMM_TILE = 128


def switches() -> tuple:
    """The switches above, as they stand: they change what a traced step holds (an executable cache's fingerprint
    carries them)."""
    return W8A16_MAX_ROWS, W8A16_KERNEL, W8A8_KERNELS, UNSCALED_GEMM_MAX_TILES


# x [N, K] -> (e4m3 [N, K], f32 scale [N, 1]), a scale per row; an all-zero row (padding tokens, a pruned channel)
# gets the smallest normal f32 and quantizes to zeros
quantize_rows = custom_calls.fp8_quantize_rows_reference


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

    def __call__(self, x, up=None, live=None):
        """x [..., in] (or silu(x) * up, the MLP's product, which W8A8 steps quantize where it is made) -> [..., out]
        in x's dtype. live: a step's real rows (linears_w8a16)."""
        x2 = x.reshape(-1, x.shape[-1])
        up2 = None if up is None else up.reshape(x2.shape)
        if x2.shape[0] > W8A16_MAX_ROWS:
            y = self.w8a8(x2, up2)
        else:
            y = self.w8a16(x2 if up2 is None else jax.nn.silu(x2) * up2, live)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias[...]

    def w8a8(self, x, up=None):
        """x [N, in] (or silu(x) * up) -> [N, out] in x's dtype: both operands e4m3, never upcast."""
        return linears_w8a8([self], x, up)[0]

    def w8a16(self, x, live=None):
        """x [N, in] -> [N, out] in x's dtype, the weight widened to x's dtype inside the GEMM."""
        return linears_w8a16([self], x, live)[0]


def linears_w8a16(layers, x, live=None) -> list:
    """x [N, in] through Fp8Linear layers that read it (q, k, v; gate, up), W8A16, without their biases. On one
    NVIDIA GPU one launch of the CUDA kernel reads all their weights (custom_calls.fp8_linear: faster than XLA's
    fused GEMM, and a launch's fixed cost is paid once), and given live (int32 [] or [1]: the step's real rows, the
    first ones) no padding row's activations (their outputs are zeros); it runs on one device only (a sharded
    weight would be gathered whole for it). Elsewhere XLA's GEMM for each, on every row."""
    ws, scales = [layer.weight[...] for layer in layers], [layer.weight_scale[...] for layer in layers]
    if w8a16_kernel(x, ws, scales):
        return custom_calls.fp8_linear(x, ws, scales, live=live)
    return [custom_calls.fp8_linear_reference(x, w, s) for w, s in zip(ws, scales)]


def w8a16_kernel(x, weights, scales) -> bool:
    """Whether linears_w8a16 runs the CUDA kernel on x and these e4m3 weights."""
    return (W8A16_KERNEL and on_one_device() and not custom_calls.decode_linear_unsupported(x, weights, scales)
            and custom_calls.available())


@dataclass(frozen=True)
class NormedRows:
    """RMSNorm(x) [N, K] left to the quantize kernel of the FP8 layers that read it (normed_input)."""
    x: jax.Array
    weight: jax.Array
    eps: float

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype


def w8a8_kernels(x, layers) -> bool:
    """Whether Fp8Linear layers reading x run W8A8 through the CUDA kernels (one NVIDIA GPU: a sharded weight would
    be gathered whole for them)."""
    return W8A8_KERNELS and on_one_device() and x.ndim == 2 and x.shape[0] > W8A16_MAX_ROWS and \
        x.dtype == jnp.bfloat16 and not any(custom_calls.fp8_w8a8_unsupported(x, layer.weight[...]) for layer in layers)


def normed_input(norm, x, layers):
    """norm(x) for the linear layers that read it; FP8 layers running W8A8 through the kernels take it as
    NormedRows, normalised inside their quantize kernel (one read of x, no normalised copy written)."""
    return NormedRows(x, norm.weight[...], norm.eps) if takes_normed_rows(x, layers) else norm(x)


def takes_normed_rows(x, layers) -> bool:
    """Whether these linear layers take x's norm as NormedRows (normed_input)."""
    return all(isinstance(layer, Fp8Linear) for layer in layers) and w8a8_kernels(x, layers)


def linears_w8a8(layers, x, up=None) -> list:
    """x [N, in] (or silu(x) * up, or NormedRows) through Fp8Linear layers that read it, W8A8, without their
    biases: x quantized once for all. On one NVIDIA GPU through the CUDA kernels (w8a8_kernels:
    custom_calls.fp8_quantize_rows or fp8_rms_norm_quantize_rows, and scaled_mm), elsewhere through XLA."""
    ws, scales = [layer.weight[...] for layer in layers], [layer.weight_scale[...] for layer in layers]
    if isinstance(x, NormedRows):
        xq, x_scale = custom_calls.fp8_rms_norm_quantize_rows(x.x, x.weight, x.eps)
    elif w8a8_kernels(x, layers):
        xq, x_scale = custom_calls.fp8_quantize_rows(x, up)
    else:
        xq, x_scale = quantize_rows(x if up is None else jax.nn.silu(x) * up)
        return [custom_calls.fp8_scaled_mm_reference(xq, x_scale, w, s, x.dtype) for w, s in zip(ws, scales)]
    return [scaled_mm(xq, x_scale, w, s) for w, s in zip(ws, scales)]


def scaled_mm(xq, x_scale, w, w_scale):
    """custom_calls.fp8_scaled_mm, or fp8_mm and the scales after it for a GEMM of few output tiles
    (UNSCALED_GEMM_MAX_TILES)."""
    if gemm_tiles(xq.shape[0], w.shape[0]) <= UNSCALED_GEMM_MAX_TILES:
        return (custom_calls.fp8_mm(xq, w) * x_scale * w_scale).astype(jnp.bfloat16)
    return custom_calls.fp8_scaled_mm(xq, x_scale, w, w_scale)


def gemm_tiles(rows: int, out_features: int) -> int:
    """GEMM_TILE x GEMM_TILE tiles of a [rows, out_features] product."""
    return -(-rows // GEMM_TILE) * -(-out_features // GEMM_TILE)


def gated_w8a16(gate_proj, up_proj, x, live=None):
    """silu(gate_proj(x)) * up_proj(x) out of one W8A16 launch (custom_calls.fp8_gated_linear: the product made
    where the kernel's sums meet, no product kernel) where the kernel takes these rows: decode rows on one NVIDIA
    GPU, bias-free FP8 gate and up of one shape. None elsewhere."""
    layers = (gate_proj, up_proj)
    if isinstance(x, NormedRows) or x.ndim != 2 or x.shape[0] > W8A16_MAX_ROWS or \
            not all(isinstance(layer, Fp8Linear) and layer.bias is None for layer in layers):
        return None
    (w_gate, w_up), (s_gate, s_up) = ([layer.weight[...] for layer in layers],
                                      [layer.weight_scale[...] for layer in layers])
    if w_gate.shape != w_up.shape or not w8a16_kernel(x, [w_gate, w_up], [s_gate, s_up]):
        return None
    return custom_calls.fp8_gated_linear(x, w_gate, s_gate, w_up, s_up, live=live)


def gated_linear(layer, gate, up, live=None):
    """layer(silu(gate) * up), the MLP's down projection: an FP8 layer of W8A8 rows quantizes the product in the
    kernel that makes it."""
    return layer(gate, up, live) if isinstance(layer, Fp8Linear) else layer(jax.nn.silu(gate) * up, live=live)


def fp8_linears(layers, x, live=None) -> list:
    """[layer(x) for layer in layers] for linear layers that read the same x; FP8 decode rows in one W8A16 launch
    (linears_w8a16, told the real rows), other FP8 rows quantized once (linears_w8a8), NormedRows normalised in
    that quantize."""
    if isinstance(x, NormedRows):
        return [y if layer.bias is None else y + layer.bias[...] for layer, y in zip(layers, linears_w8a8(layers, x))]
    x2 = x.reshape(-1, x.shape[-1])
    if len(layers) == 1 or not all(isinstance(layer, Fp8Linear) for layer in layers):
        return [layer(x, live=live) for layer in layers]
    ys = linears_w8a16(layers, x2, live) if x2.shape[0] <= W8A16_MAX_ROWS else linears_w8a8(layers, x2)
    return [(y if layer.bias is None else y + layer.bias[...]).reshape(*x.shape[:-1], -1)
            for layer, y in zip(layers, ys)]
