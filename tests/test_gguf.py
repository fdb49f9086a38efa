"""GGUF loading for every tensor type the gguf package dequantizes (K-quants included): dequantized weights,
the llama.cpp q/k row order, and a clear error for a type it cannot dequantize."""
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from jaxserve.models.errors import ModelLoadError
from jaxserve.models.gguf import GLOBAL_NAMES, TENSOR_NAMES
from jaxserve.models.loader import load_model

from test_models import TINY, forward_logits, greedy, hf_logits, rel_err

# Byte offsets of the fp16 super-block scales in each K-quant block (llama.cpp's ggml-common.h). gguf.quants
# cannot quantize to K-quants, so tests write random blocks whose scales are set small and finite.
K_QUANT_F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QUANT_F16_SCALES]
HEADS, KV_HEADS = 4, 2
K_TINY = {**TINY, "hidden_size": 256, "intermediate_size": 512}   # K-quant rows are blocks of 256 values


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**K_TINY)).eval()


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to q/k rows (interleaved rope); the loader must undo it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name):
    for g, h in GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}." + next(g for g, h in TENSOR_NAMES.items() if h == suffix)


def llama_writer(path, cfg):
    """A GGUFWriter holding cfg's llama metadata."""
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_context_length, 512),
                       (w.add_vocab_size, cfg.vocab_size), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_parameters["rope_theta"])):
        add(value)
    return w


def close_writer(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def encoded(x, kind, rng):
    """x as the bytes of GGML type kind; for a K-quant, random blocks of x's shape instead."""
    if kind.name not in K_QUANT_F16_SCALES:
        return quantize(x, kind)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (x.shape[0], x.shape[1] // block_size, type_size), np.uint8)
    for at in K_QUANT_F16_SCALES[kind.name]:
        scales = rng.uniform(1e-4, 1e-3, (*blocks.shape[:-1], 1)).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(x.shape[0], -1)


def write_gguf(path, hf, qtype):
    """Write hf's weights as a llama GGUF: matrices in qtype (a type name, or a function of the HF name giving
    one), norms F32. Return the weights a reader gets back, in HF order."""
    type_of = qtype if callable(qtype) else lambda name: qtype
    w, rng = llama_writer(path, hf.config), np.random.default_rng(0)
    stored = {}
    for name, t in hf.state_dict().items():
        x = t.numpy()
        n_head = HEADS if "q_proj" in name else KV_HEADS
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = llama_cpp_permute(x, n_head)
        kind = GGMLQuantizationType[type_of(name)] if x.ndim == 2 else GGMLQuantizationType.F32
        data = encoded(x, kind, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if kind == GGMLQuantizationType.F32 else kind)
        stored[name] = dequantize(data, kind).reshape(x.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # what an HF-layout reader must end up with
            stored[name] = stored[name].reshape(n_head, x.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2)
            stored[name] = stored[name].reshape(x.shape)
    close_writer(w)
    return stored


def with_weights(hf, weights):
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()})
    return hf


def kernel(loaded, layer, module, proj):
    return np.asarray(getattr(getattr(loaded.model.layers[layer], module), proj).kernel.get_value())


@pytest.mark.parametrize("qtype", TYPES)
def test_every_supported_type_loads_to_the_hf_model_of_the_same_weights(tmp_path, qtype):
    hf = tiny_llama()
    original = hf.model.layers[0].mlp.up_proj.weight.detach().numpy().copy()
    stored = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf, qtype)
    ours = load_model(str(tmp_path / f"tiny-{qtype}.gguf"), dtype="f32")
    assert ours.config.tie_word_embeddings is False and ours.tokenizer is None
    # exactly what gguf.quants.dequantize gives, as [in, out] kernels, q rows back in HF order
    np.testing.assert_array_equal(kernel(ours, 0, "mlp", "up_proj"), stored["model.layers.0.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(kernel(ours, 1, "self_attn", "q_proj"),
                                  stored["model.layers.1.self_attn.q_proj.weight"].T)
    ids = list(range(1, 40))
    assert rel_err(forward_logits(ours, ids), hf_logits(with_weights(hf, stored), ids)) <= 1e-4
    quantized = stored["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(quantized, original) == (qtype == "F32")   # the type really went through the file


def q4_k_m(hf_name):
    """The mix of a llama.cpp Q4_K_M file, simplified: Q6_K for attn_v, ffn_down and output, Q4_K elsewhere."""
    return "Q6_K" if hf_name.endswith(("v_proj.weight", "down_proj.weight", "lm_head.weight")) else "Q4_K"


def test_a_k_quant_mix_generates_as_its_f32_dequantization(tmp_path):
    hf = tiny_llama()
    stored = write_gguf(tmp_path / "tiny-Q4_K_M.gguf", hf, q4_k_m)
    write_gguf(tmp_path / "tiny-F32.gguf", with_weights(hf, stored), "F32")
    k_quant, f32 = (load_model(str(tmp_path / f"tiny-{kind}.gguf"), dtype="f32") for kind in ("Q4_K_M", "F32"))
    f32_params = dict(nnx.to_flat_state(nnx.state(f32.model)))
    for path, param in nnx.to_flat_state(nnx.state(k_quant.model)):   # exactly gguf.quants' dequantization
        np.testing.assert_array_equal(param.get_value(), f32_params[path].get_value(), err_msg=str(path))
    ids = list(range(1, 20))
    assert greedy(k_quant, ids, 8) == greedy(f32, ids, 8)


def test_a_type_gguf_cannot_dequantize_is_a_load_error_naming_tensor_and_type(tmp_path):
    path = tmp_path / "tiny-I32.gguf"
    w = llama_writer(path, tiny_llama().config)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((K_TINY["intermediate_size"], K_TINY["hidden_size"]), np.int32))
    close_writer(w)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(path), dtype="f32")
    assert str(error.value) == (f"{path}: tensor blk.0.ffn_up.weight has GGUF type I32, "
                                "which the gguf package cannot dequantize")
