"""FP8 weights (jaxserve/models/fp8.py): Fp8Linear against an exact and a float reference, a tiny Llama quantized
at load against its float model (on one device and split over CPU devices), the pre-quantized checkpoint layouts
(compressed-tensors, transformers' block-wise "fp8") and KV cache scales, the orbax round trip; on an sm_89+ GPU,
the FP8 GEMMs in the compiled graph of Llama-3-8B's layers and their numbers.

GPU tests skip on CPU; on a GPU run `JAX_PLATFORMS=cuda pytest tests/test_fp8_weights.py` (conftest defaults
JAX_PLATFORMS to cpu). Run as a script (`python tests/test_fp8_weights.py N FLOAT_CKPT BLOCK_CKPT`), this file is
the tensor-parallel worker: the CPU must be split into N devices before JAX starts (see tests/tp_worker.py)."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.fp8 import (FP8, UNSCALED_GEMM_MAX_TILES, W8A16_MAX_ROWS, Fp8Linear, NormedRows, fp8_linears,
                                 gated_linear, quantize_rows, quantize_weight)
from jaxserve.models.llama import RMSNorm, fuse_qkv
from jaxserve.models.loader import load_model, load_run, random_model, save_converted
from jaxserve.sharding import make_mesh, param_spec

from helpers import INSTRUCTION, KNOBS, TINY, TINY_HF_KWARGS, forward_logits, greedy, on_gpu, rel_err, token_prompts

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_REL = 2.0 ** -4          # a normal e4m3 value rounds within half its spacing, 2^-3 relative (3 mantissa bits)
E4M3_SUBNORMAL = 2.0 ** -10   # half the subnormal spacing (2^-9), in units of the tensor's scale
F32_EPS = 2.0 ** -24          # unit roundoff of an f32 addition
LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
PROMPT = [2 + (7 * i) % 120 for i in range(40)]
KV_HEADS = TINY_HF_KWARGS["num_key_value_heads"]
WORKER_TIMEOUT_S = 240
# Logits of a tiny random model whose 14 linear layers each add e4m3 rounding (up to 2^-4 of each weight and
# activation): they move by a few percent from the float model's (measured 4%)
QUANTIZED_RTOL = 0.1
# The same float weights quantized two ways (per tensor, or through 2-D blocks then per channel, against per
# channel): each model's logits some 3-4% from the float ones, independently; measured 4-6% apart
LAYOUT_RTOL = 0.15


def assert_close(actual, expected, *, rtol=0.0, atol=0.0):
    """assert_allclose that lets no NaN through (its equal_nan passes NaN against NaN)."""
    assert np.isfinite(actual).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def activations(rng, n: int, k: int) -> np.ndarray:
    """Rows of every scale a layer meets, 1e-4 to 1e4, and a zero row (padding tokens)."""
    x = rng.standard_normal((n, k)).astype(np.float32) * np.logspace(-4, 4, n, dtype=np.float32)[:, None]
    x[n // 2] = 0
    return x


def fp8_linear(rng, k: int, n: int, dtype=jnp.float32) -> tuple[Fp8Linear, np.ndarray, np.ndarray]:
    """An Fp8Linear holding a random float weight [n, k] quantized, with a random bias; and the two."""
    w, b = rng.standard_normal((n, k)).astype(np.float32) * 0.05, rng.standard_normal(n).astype(np.float32)
    layer = Fp8Linear(k, n, use_bias=True, dtype=dtype, rngs=nnx.Rngs(0))
    q, scale = quantize_weight(jnp.asarray(w))
    layer.weight.set_value(q)
    layer.weight_scale.set_value(scale)
    layer.bias.set_value(jnp.asarray(b, dtype))
    return layer, w, b


def dequantized(layer: Fp8Linear, x) -> tuple[np.ndarray, np.ndarray]:
    """(activations, weight) as the GEMM sees them, dequantized in f64: the activations through e4m3 (W8A8) in
    steps of more than W8A16_MAX_ROWS rows, as they are below."""
    w = np.asarray(layer.weight[...], np.float64) * np.asarray(layer.weight_scale[...], np.float64)[:, None]
    if len(x) <= W8A16_MAX_ROWS:
        return np.asarray(x, np.float64), w
    xq, x_scale = quantize_rows(jnp.asarray(x))
    return np.asarray(xq, np.float64) * np.asarray(x_scale, np.float64), w


def test_activations_quantize_per_row_each_amax_to_e4m3_max():
    x = activations(np.random.default_rng(), 9, 64)
    q, scale = quantize_rows(jnp.asarray(x))
    assert q.dtype == FP8 and scale.shape == (9, 1)
    amax = np.abs(np.asarray(q, np.float32)).max(axis=1)
    assert (amax[x.any(axis=1)] == E4M3_MAX).all() and amax[4] == 0 and np.isfinite(np.asarray(scale)).all()


@pytest.mark.parametrize("rows", [W8A16_MAX_ROWS, W8A16_MAX_ROWS + 1], ids=["w8a16", "w8a8"])
def test_fp8_linear_matches_the_dequantized_reference(rows):
    """The same e4m3 operands and scales in f64: only f32 rounding and the summation order differ, within the
    classical bound of K additions and the scales' few products ((K + 4) u sum |x w|)."""
    rng = np.random.default_rng()
    layer, _, b = fp8_linear(rng, 256, 96)
    x = activations(rng, rows, 256)
    with jax.default_matmul_precision("float32"):   # a GPU's f32 dots default to TF32's 10-bit mantissa
        out = np.asarray(layer(jnp.asarray(x)))
    xd, wd = dequantized(layer, x)
    bound = (256 + 4) * F32_EPS * (np.abs(xd) @ np.abs(wd).T + np.abs(b))
    assert np.isfinite(out).all() and (np.abs(out - (xd @ wd.T + b)) <= bound).all()
    np.testing.assert_array_equal(out[rows // 2], b)   # the zero row: exactly the bias


@pytest.mark.parametrize("rows", [1, W8A16_MAX_ROWS, W8A16_MAX_ROWS + 1])
def test_layers_of_one_input_give_what_each_gives(rows):
    """fp8_linears (q/k/v, gate/up: one W8A16 launch on a GPU, or one quantize of x for W8A8) against each layer
    alone, biases included: the same products in each output, so the same bits."""
    rng = np.random.default_rng()
    layers = [fp8_linear(rng, 256, n, jnp.bfloat16)[0] for n in (128, 64, 64)]
    x = jnp.asarray(activations(rng, rows, 256), jnp.bfloat16)
    for together, alone in zip(nnx.jit(fp8_linears)(layers, x), [nnx.jit(layer)(x) for layer in layers]):
        np.testing.assert_array_equal(np.asarray(together, np.float32), np.asarray(alone, np.float32))


def test_layers_normalise_normed_rows_as_the_norm_does():
    """NormedRows (an RMSNorm left to the W8A8 quantize kernel) through fp8_linears: what the layers give on the
    norm's output, biases included. Exactly where the norm is XLA's; within an e4m3 step of each input element
    (2^-3) where a GPU's kernel normalises (its sum of squares, in another order, may round a value differently)."""
    rng = np.random.default_rng()
    layers = [fp8_linear(rng, 256, n, jnp.bfloat16)[0] for n in (128, 64)]
    norm = RMSNorm(256, 1e-5, jnp.bfloat16)
    norm.weight.set_value(jnp.asarray(rng.uniform(-2, 2, 256), jnp.bfloat16))
    x = jnp.asarray(activations(rng, W8A16_MAX_ROWS + 8, 256), jnp.bfloat16)
    got = nnx.jit(lambda ls, n, x: fp8_linears(ls, NormedRows(x, n.weight[...], n.eps)))(layers, norm, x)
    want = nnx.jit(lambda ls, n, x: fp8_linears(ls, n(x)))(layers, norm, x)
    h = np.abs(np.asarray(norm(x), np.float64))
    for layer, g, w in zip(layers, got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if not on_gpu():
            np.testing.assert_array_equal(g, w)
        _, wd = dequantized(layer, np.zeros((1, 256)))
        assert (np.abs(g - w) <= 2.0 ** -7 * np.abs(w) + 2.0 ** -3 * (h @ np.abs(wd).T)).all()


@pytest.mark.parametrize("rows", [W8A16_MAX_ROWS, W8A16_MAX_ROWS + 1], ids=["w8a16", "w8a8"])
def test_the_down_projection_takes_the_silu_product_as_its_input(rows):
    """gated_linear (the MLP's down projection; W8A8 steps quantize the product where it is made) gives what the
    layer gives on silu(gate) * up, and not what it gives on gate * up. The same bits where the product is XLA's;
    the GPU's quantize kernel may round a product differently (its exp is not XLA's), which moves that element
    by an e4m3 step (2^-3 of it) at most."""
    rng = np.random.default_rng()
    layer = fp8_linear(rng, 256, 64, jnp.bfloat16)[0]
    gate, up = (jnp.asarray(activations(rng, rows, 256), jnp.bfloat16) for _ in range(2))
    out = np.asarray(nnx.jit(gated_linear)(layer, gate, up), np.float64)
    _, wd = dequantized(layer, np.zeros((1, 256)))
    for product, same in ((lambda g, u: jax.nn.silu(g) * u, True), (lambda g, u: g * u, False)):
        ref = np.asarray(nnx.jit(lambda m, g, u: m(product(g, u)))(layer, gate, up), np.float64)
        h = np.abs(np.asarray(product(gate, up), np.float64))
        bound = 2.0 ** -7 * np.abs(ref) + 2.0 ** -3 * (h @ np.abs(wd).T)
        close = np.array_equal(out, ref) if rows <= W8A16_MAX_ROWS or not on_gpu() else \
            (np.abs(out - ref) <= bound).all()
        assert close == same


@pytest.mark.parametrize("rows", [W8A16_MAX_ROWS, W8A16_MAX_ROWS + 1], ids=["w8a16", "w8a8"])
def test_fp8_linear_is_within_e4m3_error_of_the_float_linear(rows):
    """Against x w^T + b in f64: each operand element off by at most 2^-4 of itself (normals) or 2^-10 of its
    tensor's scale (subnormals), so each output by at most the sum of those errors' products. W8A16 steps leave
    the activations exact."""
    rng = np.random.default_rng()
    layer, w, b = fp8_linear(rng, 256, 96)
    x = activations(rng, rows, 256).astype(np.float64)
    out = np.asarray(layer(jnp.asarray(x, jnp.float32)))
    x_scale = np.abs(x).max(axis=1, keepdims=True) / E4M3_MAX
    w_scale = np.asarray(layer.weight_scale[...], np.float64)[:, None]
    ex = np.maximum(E4M3_REL * np.abs(x), E4M3_SUBNORMAL * x_scale) * (rows > W8A16_MAX_ROWS)
    ew = np.maximum(E4M3_REL * np.abs(w), E4M3_SUBNORMAL * w_scale)
    bound = np.abs(x) @ ew.T + ex @ np.abs(w).T + ex @ ew.T + 1e-4 * (np.abs(x) @ np.abs(w).T + np.abs(b))
    assert np.isfinite(out).all() and (np.abs(out - (x @ w.T + b)) <= bound).all()


def test_weights_quantize_per_output_channel_from_either_layout():
    w = np.random.default_rng().standard_normal((48, 80)).astype(np.float32)
    q, scale = quantize_weight(jnp.asarray(w))
    q_t, scale_t = quantize_weight(jnp.asarray(w.T), out_axis=1)
    assert q.dtype == FP8 and q.shape == (48, 80) and scale.shape == (48,)
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), np.asarray(q, np.float32))
    np.testing.assert_array_equal(scale_t, scale)
    assert_close(np.asarray(scale), np.abs(w).max(axis=1) / E4M3_MAX, rtol=1e-6)


def test_fp8_weights_are_placed_as_the_kernels_reversed():
    """Column-parallel: weight [out, in] split on out, its scales with it; row-parallel: split on in, scales
    whole; kv projections whole where the kv heads are fewer than the devices."""
    attn = ("layers", 0, "self_attn")
    assert param_spec((*attn, "q_proj", "weight"), 2, True, True) == P("tp", None)
    assert param_spec((*attn, "q_proj", "weight_scale"), 1, True, True) == P("tp")
    assert param_spec((*attn, "o_proj", "weight"), 2, True, True) == P(None, "tp")
    assert param_spec((*attn, "o_proj", "weight_scale"), 1, True, True) == P()
    assert param_spec((*attn, "k_proj", "weight_scale"), 1, False, True) == P()
    assert param_spec((*attn, "q_norm", "weight"), 1, True, True) == P(None)


def linear_layers(model) -> list:
    return [getattr(m, name) for layer in model.layers for m in (layer.self_attn, layer.mlp)
            for name in vars(m) if name.endswith("_proj") and getattr(m, name) is not None]


def test_quantized_tiny_llama_stays_close_to_its_float_model():
    """The same seed's float weights, each decoder linear quantized; embeddings and the LM head stay float."""
    float_model, fp8_model = random_model(TINY, jnp.float32), random_model(TINY, jnp.float32, quantization="fp8")
    layers = linear_layers(fp8_model.model)
    assert len(layers) == 7 * TINY.num_layers and fp8_model.quantization == "fp8"
    assert all(isinstance(x, Fp8Linear) and x.weight[...].dtype == FP8 for x in layers)
    assert isinstance(fp8_model.model.lm_head, nnx.Linear) and fp8_model.dtype == jnp.float32
    assert rel_err(forward_logits(fp8_model, PROMPT), forward_logits(float_model, PROMPT)) <= QUANTIZED_RTOL


def test_engine_serves_an_fp8_model_as_its_forward_computes_it():
    """Paged attention, batching and chunked prefill around Fp8Linear: activation scales are per token, so a
    token's result does not depend on its batch, and greedy tokens equal the plain forward's. On one device the
    engine fuses q, k and v."""
    loaded = random_model(TINY, jnp.float32, quantization="fp8")
    llm = LLM(loaded, **{**KNOBS, "num_blocks": 64, "precompile": False})
    assert all(layer.self_attn.qkv_proj is not None for layer in loaded.model.layers)
    prompts = token_prompts(5, 17, 90)   # 90 > the 64-token budget: chunked
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(loaded, p, 6) for p in prompts]


def test_decode_launches_are_told_the_steps_live_rows(monkeypatch):
    """Each W8A16 launch of the engine's steps is given the step's real rows (on a GPU the kernel then reads no
    padding row's activations and writes zeros there; here the reference does the same), the MLP's gate and up
    one gated launch (the product made in it): greedy tokens those of the plain forward through XLA's GEMMs."""
    import custom_calls
    from jaxserve.models import fp8
    seen, gated = [], []

    def launch(x, ws, scales, live=None):
        seen.append(live)
        return [custom_calls.fp8_linear_reference(x, w, s, live) for w, s in zip(ws, scales)]

    def gated_launch(x, w_gate, s_gate, w_up, s_up, live=None):
        gated.append(live)
        return custom_calls.fp8_gated_linear_reference(x, w_gate, s_gate, w_up, s_up, live)
    loaded = random_model(TINY, jnp.float32, quantization="fp8")
    prompts = token_prompts(3, 5, 9)
    want = [greedy(loaded, p, 5) for p in prompts]   # the plain forward, no kernel: no paged step, every row
    monkeypatch.setattr(fp8, "w8a16_kernel", lambda x, ws, scales: True)
    monkeypatch.setattr(custom_calls, "fp8_linear", launch)
    monkeypatch.setattr(custom_calls, "fp8_gated_linear", gated_launch)
    jax.clear_caches()   # layers traced by another test would not call the patched launch
    try:
        llm = LLM(loaded, **{**KNOBS, "num_blocks": 64, "precompile": False})
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    finally:
        jax.clear_caches()   # nor may a later test run layers traced with it
    assert seen and all(live is not None for live in seen)
    assert gated and all(live is not None for live in gated)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_quantization_is_checked_and_read_from_the_run_config(tmp_path):
    with pytest.raises(ValueError, match="quantization 'int8' is not supported; use one of None, 'fp8'"):
        load_model(quantization="int8")
    config = tmp_path / "fp8.yaml"
    shapes = json.dumps({**TINY_HF_KWARGS, "model_type": "llama"})
    config.write_text(f"model: random\ndtype: f32\nquantization: fp8\nrandom_model: {shapes}\n")
    loaded, _ = load_run(config=str(config))
    assert loaded.quantization == "fp8" and isinstance(loaded.model.layers[0].mlp.down_proj, Fp8Linear)


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def e4m3(w: np.ndarray, scale) -> np.ndarray:
    """w / scale in e4m3, clipped as a converter must (an overflowing cast is NaN)."""
    return np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def over_blocks(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A scale per BLOCK repeated over the elements of a weight of the given shape."""
    return np.repeat(np.repeat(scale, BLOCK[0], axis=0)[:shape[0]], BLOCK[1], axis=1)[:, :shape[1]]


def block_scales(w: np.ndarray) -> np.ndarray:
    """A scale per BLOCK: [ceil(out / b0), ceil(in / b1)], the edge blocks partial."""
    (out, inp), (b0, b1) = w.shape, BLOCK
    scale = np.zeros((-(-out // b0), -(-inp // b1)), np.float32)
    for i, j in np.ndindex(scale.shape):
        scale[i, j] = np.abs(w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]).max() / E4M3_MAX
    return scale


def per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.maximum(np.abs(w).max(axis=1) / E4M3_MAX, np.finfo(np.float32).tiny).astype(np.float32)
    return e4m3(w, scale[:, None]), scale


CT_SCHEME = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": {**CT_SCHEME, "strategy": "tensor"},
    "config_groups": {
        "attention": {"targets": ["re:.*self_attn.*"], "weights": {**CT_SCHEME, "strategy": "tensor"},
                      "input_activations": {**CT_SCHEME, "strategy": "tensor"}},
        "mlp": {"targets": ["re:.*mlp.*"], "weights": {**CT_SCHEME, "strategy": "channel"},
                "input_activations": {**CT_SCHEME, "strategy": "token", "dynamic": True}}}}
BLOCK = (48, 40)   # edge blocks partial in every matrix of the tiny model (64, 32, 128 rows; 64, 128 columns)
HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
# k_scale / v_scale as compressed-tensors writes them: per tensor (layer 0, shape []) or per kv head (layer 1)
KV_SCALES = {0: np.array(0.05, np.float32), 1: np.array([0.03, 0.07], np.float32)}


def compressed_tensors_tensors(name: str, w: np.ndarray) -> dict:
    """A linear weight as llm-compressor writes it: attention per tensor (scale [] or [1]), MLP per channel
    ([out, 1]); an input_scale beside each (static: read and ignored)."""
    base = name.removesuffix(".weight")
    if ".mlp." in name:
        q, scale = per_channel(w)
        scale = scale[:, None]
    else:
        scale = np.asarray(np.abs(w).max() / E4M3_MAX, np.float32).reshape(() if "q_proj" in name else (1,))
        q = e4m3(w, scale)
    return {name: q, f"{base}.weight_scale": scale, f"{base}.input_scale": np.array([0.1], np.float32)}


def block_tensors(name: str, w: np.ndarray) -> dict:
    """A linear weight as transformers' FineGrainedFP8 (DeepSeek's layout) writes it."""
    scale = block_scales(w)
    return {name: e4m3(w, over_blocks(scale, w.shape)), f"{name}_scale_inv": scale}


def write_fp8_checkpoint(src, dst, quantization_config: dict, quantize) -> dict:
    """src's float checkpoint with each decoder linear's weight replaced by quantize(name, w)'s tensors, and
    quantization_config in config.json. Returns every tensor written."""
    from safetensors.numpy import load_file, save_file
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        tensors.update(quantize(name, w) if LINEAR.search(name) else {name: w})
    if quantization_config["quant_method"] == "compressed-tensors":
        for layer, value in KV_SCALES.items():
            for kind in ("k", "v"):
                tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = np.asarray(value * (2 if kind == "v" else 1))
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return tensors


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """A fresh random tiny Llama at Llama's own initializer range: at TINY_HF_KWARGS' 0.1 its logits swing by 12%
    under any e4m3 rounding, too chaotic to tell two roundings apart."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("tiny-float")
    config = transformers.LlamaConfig(**{**TINY_HF_KWARGS, "initializer_range": 0.02})
    torch.manual_seed(0)   # one draw on every run: the tensor-parallel bound below depends on the draw
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def quantized_at_load(float_checkpoint):
    return load_model(str(float_checkpoint), "f32", quantization="fp8")


@pytest.fixture(scope="module")
def compressed_tensors(float_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("ct") / "model"
    return path, write_fp8_checkpoint(float_checkpoint, path, COMPRESSED_TENSORS, compressed_tensors_tensors)


@pytest.fixture(scope="module")
def block_checkpoint(float_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("block") / "model"
    return path, write_fp8_checkpoint(float_checkpoint, path, HF_FP8, block_tensors)


def module_of(model, hf_name: str):
    _, layer, group, proj, _ = hf_name.removeprefix("model.").split(".")
    return getattr(getattr(model.layers[int(layer)], group), proj)


def test_compressed_tensors_checkpoint_loads_as_written(compressed_tensors, quantized_at_load):
    path, written = compressed_tensors
    loaded = load_model(str(path), "f32")
    assert loaded.quantization == "fp8" and loaded.kv_scales_loaded
    for name in filter(LINEAR.search, written):
        layer = module_of(loaded.model, name)
        out = written[name].shape[0]
        np.testing.assert_array_equal(np.asarray(layer.weight[...]).view(np.uint8), written[name].view(np.uint8))
        scale = written[name.removesuffix("weight") + "weight_scale"]
        np.testing.assert_array_equal(layer.weight_scale[...], np.broadcast_to(scale.reshape(-1), (out,)))
    for i, scale in KV_SCALES.items():
        attn = loaded.model.layers[i].self_attn
        np.testing.assert_array_equal(attn.k_scale[...], np.broadcast_to(scale, (KV_HEADS,)))
        np.testing.assert_array_equal(attn.v_scale[...], np.broadcast_to(2 * scale, (KV_HEADS,)))
    assert not quantized_at_load.kv_scales_loaded
    np.testing.assert_array_equal(quantized_at_load.model.layers[0].self_attn.k_scale[...], np.ones(KV_HEADS))
    assert rel_err(forward_logits(loaded, PROMPT), forward_logits(quantized_at_load, PROMPT)) <= LAYOUT_RTOL


def test_block_fp8_checkpoint_is_requantized_per_channel(block_checkpoint, quantized_at_load):
    """Block scales dequantized in f32, then a scale per output channel (what our GEMM takes): each weight within
    one e4m3 rounding of the written one (XLA and numpy may round a tie apart, so not bit for bit)."""
    path, written = block_checkpoint
    loaded = load_model(str(path), "f32")
    assert loaded.quantization == "fp8" and not loaded.kv_scales_loaded
    for name in filter(LINEAR.search, written):
        layer, w = module_of(loaded.model, name), written[name]
        stored = w.astype(np.float32) * over_blocks(written[name + "_scale_inv"], w.shape)
        scale = np.asarray(layer.weight_scale[...])[:, None]
        assert_close(scale[:, 0], np.abs(stored).max(axis=1) / E4M3_MAX, rtol=1e-6)
        error = np.abs(np.asarray(layer.weight[...], np.float32) * scale - stored)
        assert (error <= np.maximum(E4M3_REL * np.abs(stored), E4M3_SUBNORMAL * scale) * (1 + 1e-6)).all()
    assert rel_err(forward_logits(loaded, PROMPT), forward_logits(quantized_at_load, PROMPT)) <= LAYOUT_RTOL


def with_config(path, tmp_path, edit):
    """The checkpoint at path copied, config.json's quantization_config edited."""
    import shutil
    copy = shutil.copytree(path, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def int8_weights(q):
    groups = {name: {**g, "weights": {**g["weights"], "type": "int"}} for name, g in q["config_groups"].items()}
    return {**q, "config_groups": groups}


@pytest.mark.parametrize("edit, fault", [
    (lambda q: {**q, "quant_method": "awq"}, "quant_method 'awq' is not supported"),
    (int8_weights, "compressed-tensors group 'attention' is not supported: weights int8 per tensor"),
    (lambda q: {**q, "format": "pack-quantized"}, "format pack-quantized"),
    (lambda q: {**q, "kv_cache_scheme": {**CT_SCHEME, "type": "int"}}, "kv_cache_scheme int8 is not supported"),
])
def test_an_unsupported_quantization_is_a_load_error_naming_it(compressed_tensors, tmp_path, edit, fault):
    path = with_config(compressed_tensors[0], tmp_path, edit)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(path), "f32")
    assert str(error.value).startswith(f"{path / 'config.json'}: ") and fault in str(error.value), error.value


def test_a_block_scale_of_the_wrong_shape_is_a_load_error(block_checkpoint, tmp_path):
    path = with_config(block_checkpoint[0], tmp_path, lambda q: {**q, "weight_block_size": [32, 32]})
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv \(3, 2\) does not fit the model \(expected \(4, 2\): "
                                             r"a scale per 32x32 block\)"):
        load_model(str(path), "f32")


def test_fp8_model_round_trips_through_orbax(compressed_tensors, tmp_path):
    loaded = load_model(str(compressed_tensors[0]), "f32")
    back = load_model(str(save_converted(loaded, tmp_path / "orbax")), "f32")
    assert back.quantization == "fp8" and back.kv_scales_loaded
    saved, restored = nnx.to_flat_state(nnx.state(loaded.model)), nnx.to_flat_state(nnx.state(back.model))
    assert [p for p, _ in saved] == [p for p, _ in restored]
    for (path, a), (_, b) in zip(saved, restored):
        assert a.get_value().dtype == b.get_value().dtype, path
        np.testing.assert_array_equal(*(np.asarray(x.get_value()).view(np.uint8) for x in (a, b)))
    np.testing.assert_array_equal(forward_logits(back, PROMPT), forward_logits(loaded, PROMPT))


# ---- tensor parallelism: this file run as a worker on N CPU devices ---------------------------------------------
def tp_worker(num_devices: int, float_ckpt: str, block_ckpt: str) -> dict:
    """Logits of three FP8 models on one device and on num_devices (a random model quantized after its build, a
    float checkpoint quantized at load, a block-wise checkpoint requantized at load), and the FP8 leaves placed
    other than param_spec says."""
    models = {"random": lambda mesh: random_model(TINY, jnp.float32, mesh=mesh, quantization="fp8"),
              "at_load": lambda mesh: load_model(float_ckpt, "f32", mesh, quantization="fp8"),
              "block": lambda mesh: load_model(block_ckpt, "f32", mesh)}
    out, wrong = {}, []
    for name, build in models.items():
        for n in (1, num_devices):
            loaded = build(make_mesh(n))
            cfg = loaded.config
            for path, var in nnx.to_flat_state(nnx.state(loaded.model)):   # before nnx.jit hands back new arrays
                want = param_spec(path, var.get_value().ndim, cfg.num_kv_heads % n == 0, cfg.vocab_size % n == 0)
                if path[-2].endswith("_proj") and var.get_value().sharding.spec != want:
                    wrong.append(f"{name}@{n}: " + ".".join(map(str, path)))
            out.setdefault(name, {})[str(n)] = forward_logits(loaded, PROMPT).tolist()
    return {"logits": out, "wrong": wrong}


@pytest.mark.slow
def test_fp8_models_split_over_two_devices_match_one(float_checkpoint, block_checkpoint):
    """Reordered f32 sums of the row-parallel layers can move an activation across an e4m3 rounding boundary:
    an element one e4m3 step (2^-3) off in a 64-wide dot, a few parts in 1e4 of the logits; an unlucky draw of the
    float checkpoint's weights put several across (2.4e-3 seen), so the bound leaves room for that. A sharding
    error costs the logits O(1)."""
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "2", str(float_checkpoint),
                          str(block_checkpoint[0])], capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["wrong"] == []
    for name, logits in result["logits"].items():
        assert rel_err(np.array(logits["2"]), np.array(logits["1"])) <= 1e-2, name


# ---- on an sm_89+ GPU ------------------------------------------------------------------------------------------------
LLAMA3_8B_LAYERS = dataclasses.replace(TINY, vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                       num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
                                       rope_theta=500000.0, max_position_embeddings=8192)
PREFILL_TOKENS = 256   # no activation [256, .] shares a weight's shape
# XLA's FP8 GEMM, and the W8A8 kernels' (cuBLASLt's FP8 GEMM with vector scales) that one GPU takes
FP8_GEMMS = ('"__cublas$lt$matmul$f8"', '"jaxserve_fp8_scaled_mm"', '"jaxserve_fp8_mm"')


@pytest.fixture
def fp8_gpu():
    if not (on_gpu() and float(getattr(jax.devices()[0], "compute_capability", 0)) >= 8.9):
        pytest.skip("needs an sm_89+ GPU for FP8 GEMMs")


def weight_shapes(cfg) -> set[tuple[int, int]]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {(cfg.num_heads * d, h), (cfg.num_kv_heads * d, h), (h, cfg.num_heads * d), (i, h), (h, i),
              ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h)}   # q, k and v fused
    return shapes | {s[::-1] for s in shapes}


def fp8_gemm_inputs(hlo: str) -> tuple[set[str], set[str]]:
    """(the entry computation's 2-D e4m3 parameters, those that reach an FP8 GEMM's operands through e4m3 values
    only): bitcasts (XLA splits a long K into a batched GEMM) and fusions (its dot merger concatenates the q/k/v
    weights) pass, any conversion stops the walk."""
    ops = {m[1]: (m[2], m[3], re.findall(r"%([\w.\-]+)", m[4].split("), ")[0]), m[4])
           for m in map(INSTRUCTION.match, hlo[hlo.index("\nENTRY"):].splitlines()[1:]) if m}
    weights = {name for name, (kind, op, _, _) in ops.items()
               if op == "parameter" and re.match(r"f8e4m3fn\[\d+,\d+\]", kind)}
    todo = [arg for _, op, args, rest in ops.values()
            if op == "custom-call" and any(f"custom_call_target={gemm}" in rest for gemm in FP8_GEMMS) for arg in args]
    reached = set()
    while todo:
        if (name := todo.pop()) in weights:
            reached.add(name)
        elif ops[name][0].startswith("f8e4m3fn"):
            todo += ops[name][2]
    return weights, reached


@pytest.mark.parametrize("tokens", [PREFILL_TOKENS, 2 * PREFILL_TOKENS])
def test_llama3_8b_layers_compile_to_fp8_gemms_on_the_weights_as_stored(fp8_gpu, tokens):
    """Every linear's e4m3 weight feeds a cuBLASLt FP8 GEMM, and nothing (no fusion either) makes a float copy of
    a weight: an f8 -> bf16 convert feeding a dot would. On one GPU they are the W8A8 kernels': a quantize for
    each input (q/k/v's one, the SiLU product's inside it), a GEMM for each weight, without scales where its output
    is at most fp8.UNSCALED_GEMM_MAX_TILES tiles of 128 x 128 (at 256 rows o's and down's)."""
    cfg = LLAMA3_8B_LAYERS
    loaded = random_model(cfg, jnp.bfloat16, quantization="fp8")
    one_device = jax.device_count() == 1
    if one_device:
        fuse_qkv(loaded.model)   # as the engine runs it there: q, k and v one GEMM
    fn = nnx.jit(lambda m, ids: m(ids, jnp.arange(ids.shape[0]))[0])
    hlo = fn.lower(loaded.model, jnp.zeros(tokens, jnp.int32)).compile().as_text()
    weights, reached = fp8_gemm_inputs(hlo)
    gemms = 5 if one_device else 7
    assert len(weights) == gemms * cfg.num_layers and reached == weights, sorted(weights - reached)
    float_arrays = {(int(a), int(b)) for a, b in re.findall(r"\b(?:bf16|f16|f32)\[(\d+),(\d+)\]", hlo)}
    assert not float_arrays & weight_shapes(cfg), float_arrays & weight_shapes(cfg)
    if one_device:
        widths = (cfg.head_dim * (cfg.num_heads + 2 * cfg.num_kv_heads), cfg.hidden_size, cfg.intermediate_size,
                  cfg.intermediate_size, cfg.hidden_size)   # q/k/v, o, gate, up, down
        unscaled = sum(-(-tokens // 128) * (width // 128) <= UNSCALED_GEMM_MAX_TILES for width in widths)
        assert hlo.count('custom_call_target="jaxserve_fp8_scaled_mm"') == (gemms - unscaled) * cfg.num_layers
        assert hlo.count('custom_call_target="jaxserve_fp8_mm"') == unscaled * cfg.num_layers
        assert hlo.count('custom_call_target="jaxserve_fp8_quantize_rows"') == 4 * cfg.num_layers


def test_llama3_8b_decode_steps_read_the_e4m3_weights_inside_their_gemms(fp8_gpu):
    """A step of W8A16_MAX_ROWS rows, compiled with the engine's options for it, hands each e4m3 weight to the
    CUDA W8A16 kernel (custom_calls.fp8_linear; q/k/v and gate/up one launch each): no float array of a weight's
    shape is made between the entry computation's kernels."""
    cfg = LLAMA3_8B_LAYERS
    loaded = random_model(cfg, jnp.bfloat16, quantization="fp8")
    if jax.device_count() == 1:
        fuse_qkv(loaded.model)   # as the engine runs it there
    fn = nnx.jit(lambda m, ids: m(ids, jnp.arange(ids.shape[0]))[0])
    hlo = fn.lower(loaded.model, jnp.zeros(W8A16_MAX_ROWS, jnp.int32)).compile(
        {"xla_gpu_dot_merger_threshold_mb": 0}).as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    float_arrays = {(int(a), int(b)) for a, b in re.findall(r"\b(?:bf16|f16|f32)\[(\d+),(\d+)\]", entry)}
    assert "f8e4m3fn[" in entry and not float_arrays & weight_shapes(cfg), float_arrays & weight_shapes(cfg)
    assert entry.count('custom_call_target="jaxserve_decode_linear"') == 4 * cfg.num_layers   # qkv, o, gate_up, down


@pytest.mark.parametrize("rows", [W8A16_MAX_ROWS, PREFILL_TOKENS], ids=["w8a16", "w8a8"])
def test_fp8_gemm_matches_the_dequantized_reference_on_gpu(fp8_gpu, rows):
    """Each of Llama-3-8B's linear shapes in bf16 against f64 from the same operands (W8A8: both e4m3; W8A16:
    bf16 activations). The bf16 output rounds within 2^-9 of itself; the FP8 tensor cores accumulate with fewer
    mantissa bits than f32 (cuBLASLt's fast accumulation, XLA's default): an H100 measured up to 8e-4 of
    sum |x w| over K = 4096 and 14336."""
    rng = np.random.default_rng()
    cfg = LLAMA3_8B_LAYERS
    for k, n in {(cfg.hidden_size, cfg.num_heads * cfg.head_dim), (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
                 (cfg.hidden_size, cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)}:
        layer, _, _ = fp8_linear(rng, k, n, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        out = np.asarray(nnx.jit(lambda m, x: m(x))(layer, x), np.float64)
        xd, wd = dequantized(layer, x)
        ref = xd @ wd.T + np.asarray(layer.bias[...], np.float64)
        bound = 2.0 ** -9 * np.abs(ref) + 2e-3 * (np.abs(xd) @ np.abs(wd).T)
        assert np.isfinite(out).all() and (np.abs(out - ref) <= bound).all(), (k, n, np.abs(out - ref).max())


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    print(json.dumps(tp_worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])))
