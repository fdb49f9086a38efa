"""GGUF loading for every tensor type the gguf package dequantizes (K-quants included): dequantized weights,
the llama.cpp q/k row order, and a clear error for a type it cannot dequantize."""
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import load_model

from helpers import (K_QUANT_F16_SCALES, TINY_HF_KWARGS, close_writer, forward_logits, greedy, hf_logits,
                     llama_writer, rel_err, write_gguf)

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QUANT_F16_SCALES]
K_TINY = {**TINY_HF_KWARGS, "hidden_size": 256, "intermediate_size": 512}   # K-quant rows are blocks of 256 values


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**K_TINY)).eval()


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
