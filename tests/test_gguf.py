"""GGUF loading for every tensor type the gguf package dequantizes (K-quants included): dequantized weights,
the llama.cpp q/k row order, a clear error for a type it cannot dequantize, and the Q4_1 / Q8_0 blocks kept as
stored for the CPU kernel."""
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from custom_calls import cpu as cpu_calls, gguf_matmul
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.gguf_blocks import GgufBlocks, GgufEmbed, GgufLinear
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
    ours = load_model(str(tmp_path / f"tiny-{qtype}.gguf"), dtype="f32", quantization="float")
    assert ours.config.tie_word_embeddings is False and ours.tokenizer is None
    # exactly what gguf.quants.dequantize gives, as [in, out] kernels, q rows back in HF order
    np.testing.assert_array_equal(kernel(ours, 0, "mlp", "up_proj"), stored["model.layers.0.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(kernel(ours, 1, "self_attn", "q_proj"),
                                  stored["model.layers.1.self_attn.q_proj.weight"].T)
    ids = list(range(1, 40))
    assert rel_err(forward_logits(ours, ids), hf_logits(with_weights(hf, stored), ids)) <= 1e-4
    quantized = stored["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(quantized, original) == (qtype == "F32")   # the type really went through the file


@pytest.mark.parametrize("qtype", list(gguf_matmul.BLOCK_TYPES))
def test_blocks_the_cpu_kernel_reads_stay_as_stored_and_compute_the_dequantized_model(tmp_path, qtype):
    """By default on one CPU device, Q4_1 / Q8_0 linear layers, embedding and LM head keep the file's blocks (q/k
    rows back in HF order); the model computes what its dequantization computes, to f32 rounding."""
    if not cpu_calls.available():
        pytest.skip(f"the CPU kernel does not run here: {cpu_calls.unavailable_reason()}")
    stored = write_gguf(tmp_path / "tiny.gguf", tiny_llama(), qtype)
    blocks, f32 = (load_model(str(tmp_path / "tiny.gguf"), "f32", quantization=q) for q in (None, "float"))
    assert (blocks.quantization, f32.quantization) == ("gguf", None)
    assert (blocks.gguf_blocks, f32.gguf_blocks) == (GgufBlocks(qtype, qtype, qtype), None)
    model = blocks.model
    assert isinstance(model.embed_tokens, GgufEmbed) and isinstance(model.lm_head, GgufLinear)
    for name, linear in [("model.layers.0.mlp.up_proj.weight", model.layers[0].mlp.up_proj),
                         ("model.layers.1.self_attn.q_proj.weight", model.layers[1].self_attn.q_proj),
                         ("lm_head.weight", model.lm_head)]:
        assert isinstance(linear, GgufLinear) and linear.weight[...].dtype == np.uint8, name
        np.testing.assert_array_equal(np.asarray(gguf_matmul.dequantize(linear.weight[...], qtype)), stored[name])
    ids = list(range(1, 40))
    # f32 sums over 256-512 products in another order than XLA's dot: relative differences of ~1e-6
    assert rel_err(forward_logits(blocks, ids), forward_logits(f32, ids)) <= 1e-5
    assert greedy(blocks, ids[:12], 8) == greedy(f32, ids[:12], 8)


def test_quantization_gguf_is_refused_where_it_cannot_keep_blocks(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q4_0")
    with pytest.raises(ModelLoadError, match="not all of one of the types Q4_1, Q8_0"):
        load_model(str(tmp_path / "tiny.gguf"), "f32", quantization="gguf")
    assert load_model(str(tmp_path / "tiny.gguf"), "f32").quantization is None   # the default dequantizes it
    with pytest.raises(ModelLoadError, match="this is not a .gguf file"):
        load_model(str(tmp_path), "f32", quantization="gguf")


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


def flat_values(loaded) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(loaded.model))}


@pytest.mark.parametrize("dtype, quantization", [("f32", None), ("bf16", "float"), ("f32", "fp8")])
def test_a_gguf_is_kept_as_loaded_and_the_next_load_reads_only_the_copy(tmp_path, monkeypatch, dtype, quantization):
    """A first load keeps the model as loaded under cache_dir; the next one reads that copy (the GGUF is not even
    opened), with every weight, the config and the sampling defaults as the first load had them."""
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(), "Q4_1")
    first = load_model(str(tmp_path / "tiny.gguf"), dtype, quantization=quantization, cache_dir=str(tmp_path / "c"))
    kept = list((tmp_path / "c" / "models").iterdir())
    assert len(kept) == 1 and (kept[0] / "weights.safetensors").exists()

    def refuse(*_):
        raise AssertionError("the GGUF was opened again")
    monkeypatch.setattr("jaxserve.models.gguf.open_gguf", refuse)
    again = load_model(str(tmp_path / "tiny.gguf"), dtype, quantization=quantization, cache_dir=str(tmp_path / "c"))
    assert (again.config, again.quantization, again.sampling_defaults, again.source) == \
        (first.config, first.quantization, first.sampling_defaults, first.source)
    want, got = flat_values(first), flat_values(again)
    assert want.keys() == got.keys() and any(v.dtype == np.dtype("float8_e4m3fn") for v in got.values()) == \
        (quantization == "fp8")
    for path, value in want.items():
        assert got[path].dtype == value.dtype and np.array_equal(got[path], value, equal_nan=False), path
    ids = list(range(1, 20))
    assert greedy(again, ids, 6) == greedy(first, ids, 6)


def test_an_edited_gguf_or_a_damaged_copy_loads_from_the_file(tmp_path):
    """The copy is keyed by the file's size and time: an edited file is loaded (and kept) anew, its old copy
    removed; a copy that does not hold the model's tensors is removed and the file loaded instead."""
    cache, path = str(tmp_path / "c"), tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama(), "Q4_1")
    load_model(str(path), "f32", cache_dir=cache)
    torch.manual_seed(1)
    edited = write_gguf(path, transformers.LlamaForCausalLM(transformers.LlamaConfig(**K_TINY)).eval(), "F32")
    loaded = load_model(str(path), "f32", cache_dir=cache)
    np.testing.assert_array_equal(kernel(loaded, 0, "mlp", "up_proj"), edited["model.layers.0.mlp.up_proj.weight"].T)
    [kept] = (tmp_path / "c" / "models").iterdir()
    from jaxserve.models.tensor_file import map_safetensors, write_safetensors
    tensors = {k: np.array(v) for k, v in map_safetensors(kept / "weights.safetensors").items()}
    tensors.pop("layers.0.mlp.up_proj.kernel")
    write_safetensors(kept / "weights.safetensors", tensors)
    again = load_model(str(path), "f32", cache_dir=cache)
    np.testing.assert_array_equal(kernel(again, 0, "mlp", "up_proj"), edited["model.layers.0.mlp.up_proj.weight"].T)
    [rewritten] = (tmp_path / "c" / "models").iterdir()
    assert "layers.0.mlp.up_proj.kernel" in map_safetensors(rewritten / "weights.safetensors")


@pytest.mark.slow
def test_the_embedded_models_copy_keeps_its_tokenizer_and_chat_template(tmp_path, monkeypatch):
    """The tokenizer built from the GGUF's vocabulary is kept with the weights: the copy's encodes, decodes and
    applies the chat template as the original does."""
    first = load_model(dtype="f32", cache_dir=str(tmp_path))
    monkeypatch.setattr("jaxserve.models.gguf.open_gguf", lambda *_: pytest.fail("the GGUF was opened again"))
    again = load_model(dtype="f32", cache_dir=str(tmp_path))
    assert again.eos_token_ids == first.eos_token_ids and again.config == first.config
    text = "<|im_start|>user\nThe 12 capitals of 1999, déjà vu?<|im_end|>"
    assert again.tokenizer.encode(text) == first.tokenizer.encode(text)
    ids = first.tokenizer.encode(text)
    assert again.tokenizer.decode(ids) == first.tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": "Hi"}]
    assert again.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        first.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    np.testing.assert_array_equal(np.asarray(again.model.embed_tokens.embedding.get_value()),
                                  np.asarray(first.model.embed_tokens.embedding.get_value()))
