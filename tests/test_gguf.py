"""GGUF loading for every supported tensor type: dequantized weights and the llama.cpp q/k row order."""
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from jaxserve.models.gguf import GLOBAL_NAMES, TENSOR_NAMES
from jaxserve.models.loader import load_model

from test_models import forward_logits, hf_logits, rel_err

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
HEADS, KV_HEADS = 4, 2


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to q/k rows (interleaved rope); the loader must undo it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name):
    for g, h in GLOBAL_NAMES.items():
        if h == hf_name:
            return g
    layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}." + next(g for g, h in TENSOR_NAMES.items() if h == suffix)


def write_gguf(path, hf, qtype):
    """Write hf's weights as a llama GGUF (matrices in qtype, norms F32); return the weights a reader gets back."""
    cfg = hf.config
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_context_length, 512),
                       (w.add_vocab_size, cfg.vocab_size), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_parameters["rope_theta"])):
        add(value)
    stored = {}
    for name, t in hf.state_dict().items():
        x = t.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = llama_cpp_permute(x, HEADS if "q_proj" in name else KV_HEADS)
        kind = GGMLQuantizationType[qtype] if x.ndim == 2 else GGMLQuantizationType.F32
        data = quantize(x, kind)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if kind == GGMLQuantizationType.F32 else kind)
        stored[name] = dequantize(data, kind).reshape(x.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # what an HF-layout reader must end up with
            n = HEADS if "q_proj" in name else KV_HEADS
            stored[name] = stored[name].reshape(n, x.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(x.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("qtype", TYPES)
def test_every_supported_type_loads_to_the_hf_model_of_the_same_weights(tmp_path, qtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   max_position_embeddings=512, initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    original = hf.model.layers[0].mlp.up_proj.weight.detach().numpy().copy()
    stored = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf, qtype)
    ours = load_model(str(tmp_path / f"tiny-{qtype}.gguf"), dtype="f32")
    assert ours.config.tie_word_embeddings is False and ours.tokenizer is None
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()})
    ids = list(range(1, 40))
    assert rel_err(forward_logits(ours, ids), hf_logits(hf, ids)) <= 1e-4
    quantized = stored["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(quantized, original) == (qtype == "F32")   # the type really went through the file
