"""Oracle tests: every model family of jaxserve/models/llama.py against HF transformers (PyTorch CPU, same weights,
f32)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxserve.models.fp8 import W8A16_MAX_ROWS
from jaxserve.models.llama import fuse_qkv
from jaxserve.models.loader import load_model, random_model, save_converted

from helpers import TEXT_PROMPTS, TINY, TINY_HF_KWARGS, forward_logits, greedy, hf_greedy, hf_logits, rel_err

LOGITS_RTOL = 1e-4
GREEDY_TOKENS = 32


@pytest.mark.slow
@pytest.mark.parametrize("prompt", TEXT_PROMPTS)
def test_smollm_last_logits_match_hf(smollm, smollm_hf, prompt):
    ids = smollm.tokenizer(prompt)["input_ids"]
    assert rel_err(forward_logits(smollm, ids)[-1], hf_logits(smollm_hf, ids)[-1]) <= LOGITS_RTOL


@pytest.mark.slow
def test_smollm_greedy_matches_hf(smollm, smollm_hf):
    ids = smollm.tokenizer(TEXT_PROMPTS[1])["input_ids"]
    assert greedy(smollm, ids, GREEDY_TOKENS) == hf_greedy(smollm_hf, ids, GREEDY_TOKENS)


@pytest.mark.slow
def test_tokenizer_matches_hf_gguf_tokenizer(smollm):
    from transformers import AutoTokenizer
    from jaxserve.models.loader import embedded_model_path
    path = embedded_model_path("smollm2-135m-instruct")
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for p in TEXT_PROMPTS + ["héllo wörld 中文 🙂 12345"]:
        assert smollm.tokenizer(p)["input_ids"] == hf_tok(p)["input_ids"]
        assert smollm.tokenizer.decode(smollm.tokenizer(p)["input_ids"]) == p


FAMILIES = {
    "llama3": lambda: transformers.LlamaConfig(**TINY_HF_KWARGS, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "mistral": lambda: transformers.MistralConfig(**TINY_HF_KWARGS, sliding_window=16),
    "qwen2": lambda: transformers.Qwen2Config(**TINY_HF_KWARGS, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY_HF_KWARGS, head_dim=32),
    # mixtures of experts: top-2 of 8 renormalised (Mixtral); top-3 of 8 as the softmax gives them, after a dense
    # first layer (Qwen3-MoE's mlp_only_layers)
    "mixtral": lambda: transformers.MixtralConfig(**{**TINY_HF_KWARGS, "intermediate_size": 48},
                                                  num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**TINY_HF_KWARGS, head_dim=32, num_experts=8,
                                                     num_experts_per_tok=3, moe_intermediate_size=48,
                                                     norm_topk_prob=False, mlp_only_layers=[0]),
}


def make_pair(name, path):
    """(jaxserve model, HF model) from one random checkpoint written with save_pretrained."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32).eval()
    if name == "qwen2":  # random biases so the qkv-bias path is exercised
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    hf.save_pretrained(path)
    return name, load_model(str(path), dtype="f32"), hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_pair(request, tmp_path_factory):
    return make_pair(request.param, tmp_path_factory.mktemp(request.param))


def test_tiny_family_logits_and_greedy_match_hf(tiny_pair):
    name, ours, hf = tiny_pair
    ids = np.random.default_rng(1).integers(0, 256, 40).tolist()  # longer than mistral's window of 16
    assert rel_err(forward_logits(ours, ids), hf_logits(hf, ids)) <= LOGITS_RTOL, name
    assert greedy(ours, ids[:8], GREEDY_TOKENS) == hf_greedy(hf, ids[:8], GREEDY_TOKENS), name


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_gives_the_three_layers_logits_bit_for_bit(quantization, bias):
    """q, k and v fused into one layer (one GEMM, what the engine runs on one device): each output channel is the
    same dot, so the logits are the three layers' bit for bit in many rows and in a decode step's few (FP8: W8A8
    and W8A16 rows; f32: XLA's GEMM and the CPU kernel); a fused weight in the wrong order, or a split at the wrong
    place, changes them (by ~0.1). FP8's few rows are the exception: the W8A16 reference is XLA:CPU's bf16 dot, which
    on some CPUs (AMX's) sums in an order that depends on the output width, so those logits may differ in their
    last f32 bits (1.3e-7 seen at |logit| < 0.5): within 1e-5."""
    prompt = [2 + (7 * i) % 120 for i in range(40)]
    loaded = random_model(dataclasses.replace(TINY, attention_bias=bias), jnp.float32, quantization=quantization)
    want = [forward_logits(loaded, ids) for ids in (prompt, prompt[:3])]
    fuse_qkv(loaded.model)
    fuse_qkv(loaded.model)   # a model already fused stays as it is
    attn, cfg = loaded.model.layers[0].self_attn, loaded.config
    assert (attn.q_proj, attn.k_proj, attn.v_proj) == (None, None, None)
    fused = attn.qkv_proj.weight if quantization else attn.qkv_proj.kernel
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert fused[...].shape == ((width, cfg.hidden_size) if quantization else (cfg.hidden_size, width))
    assert (attn.qkv_proj.bias is not None) == bias
    for ids, logits in zip((prompt, prompt[:3]), want):
        if quantization and len(ids) <= W8A16_MAX_ROWS:
            np.testing.assert_allclose(forward_logits(loaded, ids), logits, rtol=0, atol=1e-5)
        else:
            np.testing.assert_array_equal(forward_logits(loaded, ids), logits)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_fused_model_saves_its_q_k_and_v_apart(quantization, tmp_path):
    """A model an engine fused (one device) converts to the checkpoint an unfused one writes: three layers, every
    parameter's bits as before the fusion; the model saved stays fused."""
    prompt = [2 + (7 * i) % 120 for i in range(40)]
    loaded = random_model(dataclasses.replace(TINY, attention_bias=True), jnp.float32, quantization=quantization)
    before = nnx.to_flat_state(nnx.state(loaded.model))
    fuse_qkv(loaded.model)
    back = load_model(str(save_converted(loaded, tmp_path / "orbax")), "f32")
    assert loaded.model.layers[0].self_attn.qkv_proj is not None
    restored = nnx.to_flat_state(nnx.state(back.model))
    assert [path for path, _ in restored] == [path for path, _ in before]
    for (path, a), (_, b) in zip(before, restored):
        bits = [np.asarray(x.get_value()).view(np.uint8) for x in (a, b)]
        np.testing.assert_array_equal(*bits, err_msg=str(path))
    np.testing.assert_array_equal(forward_logits(back, prompt), forward_logits(loaded, prompt))


def test_oracle_catches_a_wrong_layer(tiny_pair):
    """Perturb one weight: the oracle comparison must fail, so the tests above can catch a broken layer."""
    name, ours, hf = tiny_pair
    ids = list(range(1, 30))
    k = ours.model.layers[1].self_attn.k_proj.kernel
    saved = k[...]
    k[...] = saved.at[0, 0].add(0.05)
    try:
        assert rel_err(forward_logits(ours, ids), hf_logits(hf, ids)) > LOGITS_RTOL, name
    finally:
        k[...] = saved


def test_mistral_window_changes_the_output(tmp_path):
    """The sliding window is really applied: disabling it changes late-position logits."""
    import dataclasses
    _, ours, _ = make_pair("mistral", tmp_path)
    ids = list(range(1, 41))
    windowed = forward_logits(ours, ids)
    for layer in ours.model.layers:
        layer.self_attn.cfg = dataclasses.replace(ours.config, sliding_window=None)
    assert rel_err(forward_logits(ours, ids)[-1], windowed[-1]) > 1e-3


MOE_FAMILIES = ("mixtral", "qwen3_moe")


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_experts_and_router_are_what_runs(name, tmp_path):
    """The oracle sees the experts and the routing rule: one expert's down projection nudged, or the top-k weights
    renormalised where the model does not (and not where it does), and the logits leave HF's."""
    _, ours, hf = make_pair(name, tmp_path)
    ids = list(range(1, 30))
    moe = ours.model.layers[1].mlp
    down = moe.experts.down_proj
    saved = down[...]
    down[...] = saved.at[:, 0, 0].add(0.05)
    try:
        assert rel_err(forward_logits(ours, ids), hf_logits(hf, ids)) > LOGITS_RTOL
    finally:
        down[...] = saved
    moe.norm_topk_prob = not moe.norm_topk_prob
    assert rel_err(forward_logits(ours, ids), hf_logits(hf, ids)) > LOGITS_RTOL


def test_moe_model_serves_through_the_engine(tmp_path):
    """The paged engine (chunked prefill, decode steps, several sequences a step) gives HF's greedy tokens on a
    mixture of experts: the experts' grouped GEMMs run inside the step graphs."""
    from jaxserve import LLM, SamplingParams
    _, ours, hf = make_pair("qwen3_moe", tmp_path)
    prompts = [np.random.default_rng(i).integers(0, 256, n).tolist() for i, n in enumerate((5, 37, 12))]
    llm = LLM(ours, max_num_seqs=4, max_num_batched_tokens=32, min_prefill_chunk=16, max_model_len=128,
              num_blocks=64, precompile=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def write_qwen3_moe_gguf(path, checkpoint, cfg):
    """The checkpoint as llama.cpp's converter writes a Qwen3-MoE: arch "qwen3moe", each projection's experts
    stacked [E, out, in] (ffn_*_exps), the router ffn_gate_inp, the dense layer's MLP as ffn_*; all F32."""
    from gguf import GGUFWriter
    from safetensors.numpy import load_file
    tensors = load_file(str(checkpoint / "model.safetensors"))
    w = GGUFWriter(str(path), "qwen3moe")
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_embedding_length, cfg.hidden_size),
                       (w.add_feed_forward_length, cfg.intermediate_size), (w.add_head_count, cfg.num_attention_heads),
                       (w.add_head_count_kv, cfg.num_key_value_heads), (w.add_key_length, cfg.head_dim),
                       (w.add_context_length, 512), (w.add_vocab_size, cfg.vocab_size),
                       (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_rope_freq_base, cfg.rope_parameters["rope_theta"]),
                       (w.add_expert_count, cfg.num_experts), (w.add_expert_used_count, cfg.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, cfg.moe_intermediate_size),
                       (w.add_expert_weights_norm, cfg.norm_topk_prob)):
        add(value)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    for name, gguf_name in (("lm_head.weight", "output.weight"), *((f"model.{k}", v) for k, v in names.items())):
        w.add_tensor(gguf_name, tensors[name])
    suffixes = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, ours in suffixes.items():
            if f"model.layers.{i}.{hf}.weight" in tensors:
                w.add_tensor(f"blk.{i}.{ours}.weight", tensors[f"model.layers.{i}.{hf}.weight"])
        for proj in ("gate", "up", "down") if i not in cfg.mlp_only_layers else ():
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", np.stack(
                [tensors[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(cfg.num_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_moe_gguf_loads_as_its_checkpoint(tmp_path):
    """A Qwen3-MoE GGUF (stacked expert tensors, a router, a dense first layer, no renormalisation) loads to the
    model its safetensors give: the config's expert fields from llama.cpp's keys, logits equal to HF's."""
    _, ours, hf = make_pair("qwen3_moe", tmp_path / "hf")
    write_qwen3_moe_gguf(tmp_path / "tiny-moe.gguf", tmp_path / "hf", hf.config)
    loaded = load_model(str(tmp_path / "tiny-moe.gguf"), dtype="f32")
    cfg = loaded.config
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 3, 48)
    assert cfg.dense_layers == (0,) and not cfg.norm_topk_prob
    ids = list(range(1, 30))
    assert rel_err(forward_logits(loaded, ids), hf_logits(hf, ids)) <= LOGITS_RTOL
