"""Mixture-of-experts plumbing without a model: config.json fields, parameter counts, expert tensors stacked at
load. The layers themselves are checked against transformers in test_llama.py (mixtral, qwen3_moe families)."""
import numpy as np
import pytest

from jaxserve.config import ModelConfig, model_config_from_hf
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import stack_experts

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}


def test_qwen3_moe_config_and_its_sizes():
    cfg = model_config_from_hf(QWEN3_30B_A3B)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 128, 8,
                                                                                               768)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.dense_layers == ()
    assert 30.4e9 < cfg.num_params < 30.6e9   # "30B"
    assert cfg.expected_experts(1) == 8 and 127 < cfg.expected_experts(256) <= 128
    active = sum(cfg.mlp_params(i, cfg.num_experts_per_tok) for i in range(cfg.num_layers))
    assert 1.8e9 < active < 1.85e9   # the MLP share of "A3B" (attention 0.9B and embeddings 0.6B the rest)


def test_qwen3_moe_dense_layers_from_the_sparse_step_and_the_list():
    cfg = model_config_from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                "mlp_only_layers": [3]})
    assert cfg.dense_layers == (0, 2, 3, 4)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_mixtral_config():
    cfg = model_config_from_hf(MIXTRAL_8X7B)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("mixtral", 8, 2,
                                                                                               14336)
    assert cfg.norm_topk_prob and not cfg.qk_norm and cfg.sliding_window is None
    assert 46.5e9 < cfg.num_params < 46.9e9   # Mixtral-8x7B's 46.7B


def test_a_bad_expert_count_is_named():
    base = dict(arch="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, max_position_embeddings=64)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        ModelConfig(**base, num_experts=8, num_experts_per_tok=9, moe_intermediate_size=4)
    with pytest.raises(ValueError, match="moe_intermediate_size must be a positive int"):
        ModelConfig(**base, num_experts=8, num_experts_per_tok=2)


def expert_tensors(experts, projs=("gate_proj", "up_proj")):
    return [(f"model.layers.0.mlp.experts.{e}.{p}.weight", np.full((2, 3), e, np.float32), (2, 3), 24)
            for e in experts for p in projs]


def test_expert_tensors_are_stacked_in_expert_order():
    passed = ("model.norm.weight", np.ones(3, np.float32), (3,), 12)
    out = list(stack_experts([passed] + expert_tensors([2, 0, 1]), 3, "ckpt"))
    assert out[0][0] == passed[0] and out[0][1] is passed[1]   # passed through untouched
    names = [name for name, *_ in out[1:]]
    assert names == ["model.layers.0.mlp.experts.gate_proj", "model.layers.0.mlp.experts.up_proj"]
    stacked = out[1][1]
    assert stacked.shape == (3, 2, 3) and [stacked[e, 0, 0] for e in range(3)] == [0, 1, 2]


def test_a_missing_or_extra_expert_is_a_load_error():
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.0\.mlp\.experts\.1\.gate_proj"):
        list(stack_experts(expert_tensors([0, 2], ("gate_proj",)), 3, "ckpt"))
    with pytest.raises(ModelLoadError, match="expert 3 of a model with 3 experts"):
        list(stack_experts(expert_tensors([3], ("gate_proj",)), 3, "ckpt"))


def test_padding_tokens_route_to_no_expert():
    """A paged step's padding tokens (past cu_q_lens[num_seqs]) go to no expert: live tokens' outputs are as
    without the mask, padding's are zeros (any expert computed for them would leave them nonzero)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.llama import MoE
    cfg = model_config_from_hf({**QWEN3_30B_A3B, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 16,
                                "num_experts_per_tok": 4, "num_hidden_layers": 1})
    moe = MoE(cfg, jnp.float32, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    masked, full = moe(x, num_live=jnp.asarray(3)), moe(x)
    np.testing.assert_allclose(masked[:3], full[:3], rtol=1e-6, atol=1e-6)   # the same sums in float32
    assert (masked[3:] == 0).all() and (full[3:] != 0).any()


def test_a_paged_steps_live_tokens_come_from_its_batch():
    """The MoE layers' live tokens are the step's first cu_q_lens[num_seqs] tokens (the rest pad the bucket)."""
    import types

    import jax.numpy as jnp

    from jaxserve.models.llama import moe_context
    batch = types.SimpleNamespace(cu_q_lens=jnp.asarray([0, 1, 2, 7, 7], jnp.int32),
                                  num_seqs=jnp.asarray([3], jnp.int32))
    mesh, num_live = moe_context(types.SimpleNamespace(batch=batch, mesh="mesh"))
    assert mesh == "mesh" and num_live.tolist() == [7]
    assert moe_context(None) == (None, None)


def test_moe_layers_keep_xlas_adds_and_norms(monkeypatch):
    """Where the add-and-norm call is taken (llama.adds_where_normed), a MoE layer keeps XLA's adds and norms (XLA
    fuses them with the experts' weighted sum and the router's inputs; the call left the H200's batch-1 step as it
    was), and so does the final norm after one; a dense layer of the same model (mlp_only_layers) takes the call
    for both its norms."""
    import jax
    import jax.numpy as jnp

    import custom_calls
    from jaxserve.models import llama
    from jaxserve.models.loader import random_model
    cfg = model_config_from_hf({**QWEN3_30B_A3B, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
                                "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "mlp_only_layers": [0]})
    calls = []
    monkeypatch.setattr(llama, "adds_where_normed", lambda *_: True)
    monkeypatch.setattr(custom_calls, "add_rms_norm",
                        lambda *args: calls.append(args[0].shape) or custom_calls.add_rms_norm_reference(*args))
    model = random_model(cfg, jnp.float32).model
    jax.clear_caches()   # layers traced by another test would not take the patched functions
    try:
        model(jnp.arange(4, dtype=jnp.int32), jnp.arange(4, dtype=jnp.int32))
    finally:
        jax.clear_caches()
    assert calls == [(4, 64)] * 2   # the dense layer's two norms; none in the MoE layer, none after it
