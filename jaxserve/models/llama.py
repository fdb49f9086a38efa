"""Llama-family decoder in Flax NNX: Llama 2/3 (llama3 rope scaling), SmolLM2, Mistral (sliding window),
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), and the mixtures of experts Mixtral and Qwen3-MoE (`MoE`). Tokens are
flattened `[T]`; attention goes through `attend`."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import custom_calls
from custom_calls.f32_matmul import MAX_ROWS as F32_KERNEL_MAX_ROWS, f32_matmuls
from jaxserve.cache.kv_cache import layer_of, with_layer
from jaxserve.config import ModelConfig
from jaxserve.models.attention import (AttentionBatch, AttentionKernels, PagedAttention, attend, attend_rotated,
                                       rotates_where_written)
from jaxserve.models.fp8 import Fp8Linear, fp8_linears, gated_linear, gated_w8a16, normed_input, takes_normed_rows
from jaxserve.models.gguf_blocks import GgufBlocks, GgufEmbed, GgufLinear, gguf_linears
from jaxserve.sharding import TP, concatenate_on_devices, on_one_device, per_shard, traced_on
from pallas_kernels.ragged_paged_attention import gpu_capability


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies as transformers computes them (default and llama3 scaling)."""
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    if not cfg.rope_scaling:
        return inv.astype(np.float32)
    sc = cfg.rope_scaling
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(is_mid, mid, scaled).astype(np.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    @jax.named_scope("rms_norm")
    def __call__(self, x):
        return custom_calls.rms_norm(x, self.weight[...], self.eps)


# bf16 decode rows on one NVIDIA GPU through custom_calls.bf16_linear (bf16_kernel_takes): off, as on the H200 it
# ties XLA's GEMMs inside a step (benchmarks/NOTES_moe.md); fewer launches a layer, for when those count
BF16_DECODE_KERNEL = False


class Linear(nnx.Linear):
    """nnx.Linear, but a decode step's few f32 rows on a lone CPU device go through the CPU library's streaming
    kernel (f32_linears), and with BF16_DECODE_KERNEL a decode step's bf16 rows on one NVIDIA GPU through the CUDA
    one (bf16_linears). Only where the step runs on one device (sharding.on_one_device): under a mesh of several
    the kernel's rows could be another device's shards."""

    def __call__(self, x, live=None):
        """live: the step's real rows (live_tokens), which the CUDA kernel reads alone."""
        if f32_kernel_takes([self], x):
            return f32_linears([self], x)[0]
        return bf16_linears([self], x, live)[0] if bf16_kernel_takes([self], x) else super().__call__(x)


def f32_kernel_takes(layers, x) -> bool:
    """Whether f32_linears runs these Linear layers reading x [T, in] through custom_calls.f32_matmuls (other
    layers' inputs may be no array: fp8.NormedRows)."""
    return (all(isinstance(layer, Linear) and layer.kernel.dtype == jnp.float32 for layer in layers)
            and len(x.shape) == 2 and x.shape[0] <= F32_KERNEL_MAX_ROWS and x.dtype == jnp.float32
            and jax.default_backend() == "cpu" and on_one_device())


def f32_linears(layers, x) -> list:
    """[layer(x) for layer in layers], f32 Linear layers that read the same x, in one call of the CPU kernel."""
    ys = f32_matmuls(x, [layer.kernel[...] for layer in layers])
    return [y if layer.bias is None else y + layer.bias[...] for layer, y in zip(layers, ys)]


def bf16_kernel_takes(layers, x) -> bool:
    """Whether bf16_linears runs these Linear layers reading x [T, in] through custom_calls.bf16_linear."""
    return (BF16_DECODE_KERNEL and all(isinstance(layer, Linear) for layer in layers) and isinstance(x, jax.Array)
            and on_one_device()
            and not custom_calls.decode_linear_unsupported(x, [layer.kernel[...] for layer in layers])
            and custom_calls.available())


def bf16_linears(layers, x, live=None) -> list:
    """[layer(x) for layer in layers], bf16 Linear layers that read the same x, in one launch of the CUDA kernel; with
    live its rows past them are zeros."""
    ys = custom_calls.bf16_linear(x, [layer.kernel[...] for layer in layers], live=live)
    return [y if layer.bias is None else y + layer.bias[...] for layer, y in zip(layers, ys)]


def linear_leaves(layer) -> dict[str, int]:
    """A float or FP8 linear layer's parameters and the axis of each that runs over its outputs."""
    axes = {"weight": 0, "weight_scale": 0} if isinstance(layer, Fp8Linear) else {"kernel": 1}
    return axes if layer.bias is None else {**axes, "bias": 0}


def out_width(layer) -> int:
    return layer.weight.shape[0] if isinstance(layer, Fp8Linear) else layer.out_features


def resized(layer, out_features: int):
    """An abstract layer of layer's kind and input width with out_features outputs (its parameters to be set)."""
    if isinstance(layer, Fp8Linear):
        return nnx.eval_shape(lambda: Fp8Linear(layer.weight.shape[1], out_features, use_bias=layer.bias is not None,
                                                dtype=layer.weight_scale.dtype, rngs=nnx.Rngs(0)))
    return nnx.eval_shape(lambda: Linear(layer.in_features, out_features, use_bias=layer.bias is not None,
                                         dtype=layer.dtype, param_dtype=layer.param_dtype, rngs=nnx.Rngs(0)))


def fuse_linears(layers):
    """One layer whose output is the given layers' side by side (each parameter concatenated on its output axis),
    for float or FP8 layers; None for others (GGUF blocks). cuBLASLt's FP8 GEMM takes ~14 us at a 256-row step
    whatever its width up to 6,144 outputs (its one algorithm with vector scales has no split of K), and XLA's
    bf16 GEMMs of k and v each carry a split-K reduction: q, k and v cost about three times one GEMM of all three."""
    if not (all(isinstance(layer, Fp8Linear) for layer in layers) or all(type(layer) is Linear for layer in layers)):
        return None
    fused = resized(layers[0], sum(map(out_width, layers)))
    for name, axis in linear_leaves(layers[0]).items():
        setattr(fused, name, nnx.Param(concatenate_on_devices([getattr(layer, name)[...] for layer in layers], axis)))
    return fused


def split_linear(fused, widths) -> list:
    """The layers fuse_linears joined into fused, given their output widths (each parameter sliced)."""
    parts, start = [], 0
    for width in widths:
        part = resized(fused, width)
        for name, axis in linear_leaves(fused).items():
            value = jax.lax.slice_in_dim(getattr(fused, name)[...], start, start + width, axis=axis)
            setattr(part, name, nnx.Param(value))
        parts.append(part)
        start += width
    return parts


def _linear(cfg_in, cfg_out, dtype, rngs, bias=False, quantization=None):
    """Linear in the model dtype, with quantization="fp8" an Fp8Linear (models/fp8.py), with GgufBlocks a GgufLinear
    of their linear block type."""
    if quantization == "fp8":
        return Fp8Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, rngs=rngs)
    if isinstance(quantization, GgufBlocks):
        return GgufLinear(cfg_in, cfg_out, quantization.linear, use_bias=bias, dtype=dtype)
    return Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class KVScale(nnx.Variable):
    """Per kv head dequantization scale of an FP8 KV cache (1 until calibrated or loaded); not a checkpoint
    parameter: a model without one loads with ones."""


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization=None, in_features: int | None = None):
        """in_features: q/k/v's input width where it is not hidden_size (EAGLE-3's layer reads 2 x hidden)."""
        h, d = cfg.hidden_size, cfg.head_dim
        x = in_features or h
        self.q_proj = _linear(x, cfg.num_heads * d, dtype, rngs, cfg.attention_bias, quantization)
        self.k_proj = _linear(x, cfg.num_kv_heads * d, dtype, rngs, cfg.attention_bias, quantization)
        self.v_proj = _linear(x, cfg.num_kv_heads * d, dtype, rngs, cfg.attention_bias, quantization)
        self.o_proj = _linear(cfg.num_heads * d, h, dtype, rngs, quantization=quantization)
        self.qkv_proj = nnx.data(None)   # q, k and v as one layer (fuse_qkv)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_scale = KVScale(jnp.ones((cfg.num_kv_heads,), jnp.float32))
        self.v_scale = KVScale(jnp.ones((cfg.num_kv_heads,), jnp.float32))
        self.cfg = cfg

    def project(self, x, positions, live=None):
        """x [T, H] -> q [T, Hq, D], k and v [T, Hkv, D], as attention sees them (normed, rotated). live: the real
        tokens (live_tokens), which FP8 decode launches read alone."""
        with jax.named_scope("qkv"):
            ys = linears(self.input_layers(), x, live)
        return self.rotated(ys, positions)

    @jax.named_scope("qkv")
    def rotated(self, ys, positions):
        """q, k and v's projections (three, or the fused layer's one) -> q [T, Hq, D], k and v [T, Hkv, D], q and k
        normed and rotated."""
        cfg, t = self.cfg, ys[0].shape[0]
        q, k, v = ys if len(ys) == 3 else jnp.split(ys[0], np.cumsum(self.qkv_widths()[:2]), axis=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k, v = (a.reshape(t, cfg.num_kv_heads, cfg.head_dim) for a in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = self.rotary().inv_freq
        with jax.named_scope("rope"):   # the name a profile's kernels carry (benchmarks/step_timeline.py)
            return custom_calls.rope(q, positions, inv_freq), custom_calls.rope(k, positions, inv_freq), v

    def rotary(self) -> custom_calls.Rotary:
        """What `rotated` applies to q and k (norms, then the rotation), for custom_calls.rope_and_cache."""
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight[...], self.k_norm.weight[...])
        return custom_calls.Rotary(rope_inv_freq(self.cfg), *norms, self.cfg.rms_norm_eps)

    def qkv_widths(self) -> tuple[int, int, int]:
        cfg = self.cfg
        return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def input_layers(self) -> tuple:
        """The linear layers that read the attention's input: q, k and v, or the one they were fused into."""
        return (self.q_proj, self.k_proj, self.v_proj) if self.qkv_proj is None else (self.qkv_proj,)

    def fuse_qkv(self) -> None:
        """q, k and v as one layer (fuse_linears: one GEMM or decode launch, not three), where they are float or
        FP8; GGUF blocks stay apart."""
        if self.qkv_proj is None and (fused := fuse_linears(self.input_layers())) is not None:
            self.qkv_proj = fused
            self.q_proj = self.k_proj = self.v_proj = None

    def split_qkv(self) -> None:
        """q, k and v as three layers again (what checkpoints hold)."""
        if self.qkv_proj is not None:
            self.q_proj, self.k_proj, self.v_proj = split_linear(self.qkv_proj, self.qkv_widths())
            self.qkv_proj = None

    def __call__(self, x, positions, kv_layer, paged):
        live = live_tokens(paged)
        kw = dict(sm_scale=self.cfg.head_dim ** -0.5, sliding_window=self.cfg.sliding_window,
                  kv_scales=(self.k_scale[...], self.v_scale[...]))
        with jax.named_scope("qkv"):
            ys = linears(self.input_layers(), x, live)
        if len(ys) == 1 and rotates_where_written(ys[0], self.cfg.num_heads, kv_layer, paged):   # one call
            out, kv_layer = attend_rotated(ys[0], positions, kv_layer, paged, self.rotary(), self.cfg.num_heads, **kw)
        else:
            out, kv_layer = attend(*self.rotated(ys, positions), positions, kv_layer, paged, **kw)
        with jax.named_scope("o_proj"):
            return self.o_proj(out.reshape(x.shape[0], -1), live=live), kv_layer


def linears(layers, x, live=None) -> list:
    """[layer(x) for layer in layers] for linear layers that read the same x (q, k, v; gate, up): GGUF blocks of one
    type in one kernel call (gguf_linears), a CPU's f32 decode rows in one (f32_linears), a GPU's bf16 decode rows
    in one launch (bf16_linears), FP8 decode rows in one W8A16 launch (fp8_linears)."""
    if all(isinstance(layer, GgufLinear) for layer in layers) and len({layer.block_type for layer in layers}) == 1:
        return gguf_linears(layers, x)
    if f32_kernel_takes(layers, x):
        return f32_linears(layers, x)
    if bf16_kernel_takes(layers, x):
        return bf16_linears(layers, x, live)
    return fp8_linears(layers, x, live)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization=None):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(h, i, dtype, rngs, quantization=quantization)
        self.up_proj = _linear(h, i, dtype, rngs, quantization=quantization)
        self.down_proj = _linear(i, h, dtype, rngs, quantization=quantization)

    @jax.named_scope("mlp")
    def __call__(self, x, live=None):
        """live: the real tokens (live_tokens), which FP8 decode launches read alone."""
        if (product := gated_w8a16(self.gate_proj, self.up_proj, x, live)) is not None:
            return self.down_proj(product, live=live)
        gate, up = linears((self.gate_proj, self.up_proj), x, live)
        return gated_linear(self.down_proj, gate, up, live)


EXPERT_DOT = jax.lax.RaggedDotDimensionNumbers(   # rows sorted by expert [N, in] . weights [E, out, in] -> [N, out]
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


class Experts(nnx.Module):
    """Every expert's MLP weights stacked, as checkpoints store each expert's: [E, out, in]; split on E over a
    "tp" mesh (expert parallelism, sharding.param_spec)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nnx.initializers.lecun_normal(in_axis=2, out_axis=1, batch_axis=0)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))


class MoE(nnx.Module):
    """Sparse MLP: each token goes to the router's top-k experts, weighed by their softmax probabilities
    (renormalised over the chosen when cfg.norm_topk_prob). The token-expert pairs are sorted by expert so that each
    projection is one grouped GEMM over [T * k] rows (static shapes: one graph per bucket, no host round trip).
    Over a "tp" mesh each device holds whole experts and every token (tokens are replicated between layers): it
    runs the pairs routed to its own experts and an all-reduce sums the devices' shares, as the row-parallel
    projections' does."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, dtype=dtype, param_dtype=dtype,
                           rngs=rngs)
        self.experts = Experts(cfg, dtype, rngs)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    @jax.named_scope("moe")
    def __call__(self, x, mesh=None, num_live=None):
        """num_live [] or [1]: the step's real tokens, the first ones (default: all); padding's pairs go to no
        expert, so a small batch in a large bucket reads only its own tokens' experts (its output rows: zeros)."""
        num_live = jnp.full((1,), x.shape[0], jnp.int32) if num_live is None else num_live.reshape(1)
        split = mesh is not None and mesh.shape[TP] > 1
        run = per_shard(functools.partial(routed_experts, top_k=self.top_k, renormalize=self.norm_topk_prob,
                                          split=split), mesh, (P(),) * 3 + (P(TP),) * 3, P())
        w = self.experts
        return run(x, self.gate(x), num_live.astype(jnp.int32), w.gate_proj[...], w.up_proj[...], w.down_proj[...])


def routed_experts(x, logits, num_live, gate_proj, up_proj, down_proj, *, top_k: int, renormalize: bool,
                   split: bool, backend: str = "auto", interpret: bool = False):
    """x [T, H] through the experts held here (all of them, or with `split` this device's share of a "tp" mesh,
    summed over the devices): sum over each token's top_k experts e by its router logits [T, E] of
    weight x down_e(silu(gate_e x) * up_e x), weights as custom_calls.select_experts gives them. backend: the
    grouped GEMMs' — "mosaic" (the Mosaic GPU kernel, planned by the CUDA routing call; `interpret` runs it on the
    CPU), "xla" (`ragged_dot_general`) or "auto" (Mosaic on Hopper, else XLA)."""
    local = gate_proj.shape[0]
    expert_base = jnp.full((1,), jax.lax.axis_index(TP) * local if split else 0, jnp.int32)
    tuning = grouped_gemm_tuning(backend, interpret, x, gate_proj, down_proj)
    experts_mlp = ragged_experts if tuning is None else functools.partial(mosaic_experts, tuning=tuning,
                                                                          interpret=interpret)
    y = experts_mlp(x, logits, num_live, expert_base, gate_proj, up_proj, down_proj, top_k=top_k,
                    renormalize=renormalize)
    return (jax.lax.psum(y, TP) if split else y).astype(x.dtype)


def grouped_gemm_tuning(backend: str, interpret: bool, rows, gate_proj, down_proj):
    """The Mosaic GPU grouped GEMM's tuning when it runs the experts, else None (XLA's ragged dot does): "auto"
    takes it on Hopper for the shapes it serves."""
    if backend == "xla" or (backend == "auto" and gpu_capability() != 9.0):
        return None
    from pallas_kernels import grouped_matmul_mgpu as gmm   # Mosaic GPU's import: only where it runs
    device = jax.devices()[0]
    # one CTA per SM; the CPU interpreter (no core count) runs a few, each taking several work units
    tuning = gmm.GroupedTuning(num_ctas=4 if interpret else getattr(device, "core_count", None) or 132)
    why_not = gmm.supported(rows, gate_proj, tuning) or gmm.supported(rows, down_proj, tuning)
    if why_not and backend == "mosaic":
        raise ValueError(f"the experts' grouped GEMM on Mosaic GPU cannot serve these shapes: {why_not}")
    return None if why_not else tuning


def ragged_experts(x, logits, num_live, expert_base, gate_proj, up_proj, down_proj, *, top_k, renormalize):
    """The routed sum by XLA: the pairs sorted by expert through XLA's ragged dots, f32 [T, H]."""
    weights, experts = custom_calls.select_experts(logits, num_live, top_k, renormalize)
    order, group_sizes = custom_calls.sort_pairs(experts, expert_base, gate_proj.shape[0])
    out = ragged_dot_mlp(x[order // top_k], group_sizes, gate_proj, up_proj, down_proj)
    rank = custom_calls.inverse_permutation(order)
    # out's rows past the routed pairs hold whatever XLA leaves there: those pairs read none
    return combine(out, jnp.where(rank < group_sizes.sum(), rank, order.shape[0]).reshape(experts.shape), weights)


def ragged_dot_mlp(rows, group_sizes, gate_proj, up_proj, down_proj):
    """Rows sorted by expert [N, H] through their expert's MLP by XLA's ragged dot: [N, H]."""
    def dot(rows, w):
        return jax.lax.ragged_dot_general(rows, w, group_sizes, EXPERT_DOT,
                                          preferred_element_type=jnp.float32).astype(rows.dtype)
    return dot(jax.nn.silu(dot(rows, gate_proj)) * dot(rows, up_proj), down_proj)


def mosaic_experts(x, logits, num_live, expert_base, gate_proj, up_proj, down_proj, *, top_k, renormalize, tuning,
                   interpret):
    """The routed sum by the Mosaic GPU grouped GEMMs, f32 [T, H]: one routing call plans the pairs, the tokens are
    gathered into the sorted rows, gate, up and the activation run in one launch into the padded row layout, down
    in another within it."""
    from pallas_kernels import grouped_matmul_mgpu as gmm
    route = custom_calls.moe_route(logits, num_live, expert_base, top_k=top_k, renormalize=renormalize,
                                   local_experts=gate_proj.shape[0], block_m=tuning.block_m)
    options = {"plan": gmm.RowPlan(route.tile_groups, route.tile_rows, route.num_tiles), "tuning": tuning,
               "interpret": interpret}
    hidden = gmm.grouped_swiglu(x[route.sorted_tokens], gate_proj, up_proj, **options)
    # tiles past the plan's hold garbage: no pair's row is there
    return combine(gmm.grouped_matmul_padded(hidden, down_proj, **options), route.pair_rows, route.weights)


@jax.named_scope("combine")
def combine(out, pair_rows, weights):
    """Each token's pairs' rows of out, weighed and summed (a gather and a reduction, no scatter-add): f32 [T, H];
    pair_rows [T, k] past out's rows: zeros."""
    rows = jnp.take(out, pair_rows, axis=0, mode="fill", fill_value=0)
    return jnp.einsum("tk,tkh->th", weights, rows.astype(jnp.float32))


def live_tokens(paged):
    """A paged step's real tokens (int32 []): its first cu_q_lens[num_seqs], the rest pad the bucket; None outside
    one."""
    return None if paged is None else paged.batch.cu_q_lens[paged.batch.num_seqs]


def moe_context(paged):
    """(mesh, live tokens) of a paged step for its MoE layers; (None, None) outside one."""
    return (None, None) if paged is None else (paged.mesh, live_tokens(paged))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quantization, layer: int):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quantization)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MoE(cfg, dtype, rngs) if cfg.is_moe_layer(layer) else MLP(cfg, dtype, rngs, quantization)

    def __call__(self, x, delta, positions, kv_layer, paged):
        """The residual stream enters as x + delta and leaves as (x, delta) again, the MLP's output not yet added:
        each add is made by the norm after it (add_normed). Returns (x, delta, kv_layer)."""
        attn, moe = self.self_attn, isinstance(self.mlp, MoE)
        x, h = add_normed(self.input_layernorm, x, delta, attn.input_layers(), fuse=not moe)
        h, kv_layer = attn(h, positions, kv_layer, paged)
        if moe:
            x, h = add_normed(self.post_attention_layernorm, x, h, fuse=False)
            return x, self.mlp(h, *moe_context(paged)), kv_layer
        x, h = add_normed(self.post_attention_layernorm, x, h, (self.mlp.gate_proj, self.mlp.up_proj))
        return x, self.mlp(h, live_tokens(paged)), kv_layer


def add_normed(norm: RMSNorm, x, delta, layers=(), fuse: bool = True):
    """(x + delta, its norm as the linear layers that read it take it (fp8.normed_input; no layers: norm's
    output)), the add and the norm one CUDA call where adds_where_normed. fuse=False keeps XLA's add and norm (a
    MoE layer's: XLA fuses them with the experts' weighted sum and the router's inputs, and the call, which needs
    those written out first, left a batch-1 step's GPU time as it was on the H200)."""
    weight = norm.weight[...]
    if fuse and adds_where_normed(x, delta, weight, layers):
        normed, total = custom_calls.add_rms_norm(x, delta, weight, norm.eps)
        return total, normed
    x = x + delta
    return x, normed_input(norm, x, layers) if layers else norm(x)


def adds_where_normed(x, delta, weight, layers) -> bool:
    """Whether add_normed runs custom_calls.add_rms_norm (XLA writes the sum and reads it back in a second launch):
    on one NVIDIA GPU, for what the call takes, but not where FP8's W8A8 kernels normalise x themselves."""
    return (on_one_device() and custom_calls.available() and custom_calls.add_rms_norm_unsupported(x, delta, weight)
            is None and not (layers and takes_normed_rows(x, layers)))


def fuse_qkv(model) -> None:
    """Each layer's q, k and v as one layer (Attention.fuse_qkv), in place: for a model on one device (on a mesh
    each device holds a shard of each, which a fused weight would need interleaved shard by shard)."""
    for layer in model.layers:
        layer.self_attn.fuse_qkv()


def split_qkv(model) -> None:
    """Each fused layer's q, k and v as three layers again (Attention.split_qkv), in place."""
    for layer in model.layers:
        layer.self_attn.split_qkv()


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, quantization: str | GgufBlocks | None = None,
                 rngs: nnx.Rngs):
        """quantization="fp8": the decoder layers' linear layers in FP8; embeddings and the LM head stay in dtype.
        GgufBlocks: the decoder's linear layers, and the embedding and LM head where they name a type, keep a GGUF
        file's blocks."""
        h, v = cfg.hidden_size, cfg.vocab_size
        blocks = quantization if isinstance(quantization, GgufBlocks) else GgufBlocks("")   # "": none
        self.embed_tokens = GgufEmbed(v, h, blocks.embedding, dtype) if blocks.embedding else \
            nnx.Embed(v, h, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, quantization, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else \
            GgufLinear(h, v, blocks.lm_head, use_bias=False, dtype=dtype) if blocks.lm_head else \
            _linear(h, v, dtype, rngs)
        self.cfg = cfg

    def __call__(self, token_ids, positions, kv_cache=None, paged: PagedAttention | None = None):
        """token_ids, positions [T] -> (final hidden states [T, H], updated kv_cache or None)."""
        hidden, kv_cache, _ = self.forward(token_ids, positions, kv_cache, paged)
        return hidden, kv_cache

    def forward(self, token_ids, positions, kv_cache=None, paged: PagedAttention | None = None,
                aux_layers: tuple[int, ...] = ()):
        """__call__, and the hidden states entering each of aux_layers (EAGLE-3's features), [T, H] each."""
        x = self.embed_tokens(token_ids)
        delta, aux = zeros_of_type(x), []   # the stream as (x, delta) into every layer: one trace for all
        batch, kernels, mesh = (None, None, None) if paged is None else (paged.batch, paged.kernels, paged.mesh)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux += [x + delta] * aux_layers.count(i)
            graphdef, state = nnx.split(layer)
            x, delta, kv_layer = run_layer(graphdef, state, x, delta, positions,
                                           None if kv_cache is None else layer_of(kv_cache, i), batch,
                                           kernels=kernels, mesh=mesh)
            kv_cache = None if kv_cache is None else with_layer(kv_cache, i, kv_layer)
        return add_normed(self.norm, x, delta, fuse=not isinstance(self.layers[-1].mlp, MoE))[1], kv_cache, aux

    def logits(self, hidden):
        """hidden [N, H] -> f32 logits [N, V]."""
        if isinstance(self.embed_tokens, GgufEmbed) and self.lm_head is None:
            return self.embed_tokens.attend(hidden)
        if self.lm_head is None:   # E [V, H] . hidden: XLA CPU streams E's rows (its hidden @ E.T is ~10x slower)
            embedding = self.embed_tokens.embedding[...]
            return jax.lax.dot_general(embedding, hidden.astype(embedding.dtype), (((1,), (1,)), ((), ()))
                                       ).T.astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)


def zeros_of_type(x):
    """Zeros of x's type, its mesh included (as a layer's outputs carry it): the first layer's call then matches
    the others' and is not traced apart."""
    sharding = jax.typeof(x).sharding
    return jnp.zeros_like(x) if sharding.mesh.empty else jax.sharding.reshard(jnp.zeros_like(x), sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "kernels", "mesh"))
def run_layer(graphdef, state, x, delta, positions, kv_layer, batch: AttentionBatch | None, *,
              kernels: AttentionKernels | None, mesh):
    """One decoder layer, a jitted call: the layers share a structure, so it is traced once per step shape rather
    than once per layer (the step graphs' tracing, on the start-up's critical path, shrinks by the layer count);
    XLA inlines the calls, so the compiled step is the same."""
    paged = None if batch is None else PagedAttention(batch, kernels, mesh)
    with traced_on(mesh):
        return nnx.merge(graphdef, state)(x, delta, positions, kv_layer, paged)


def abstract_model(cfg: ModelConfig, dtype, quantization: str | GgufBlocks | None = None) -> LlamaForCausalLM:
    """Shape-only model (no memory); loaders fill its state."""
    return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype, quantization=quantization, rngs=nnx.Rngs(0)))
