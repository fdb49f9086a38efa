"""Tensor parallelism (jaxserve/sharding.py) on CPU: the checks that need several devices run in child processes
(tests/tp_worker.py) with the host split into 2 and 4 devices; the rest (config, CLI, refusals, the tp=1 graph) run
here."""
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import LLM
from jaxserve.cli import build_parser, served_engine_config
from jaxserve.config import EngineConfig, load_run_config
from jaxserve.models.loader import load_run, random_model
from jaxserve.sharding import cache_kv_heads, check_tensor_parallel, make_mesh, on_one_device, param_spec, traced_on

from helpers import KNOBS, TINY

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
WORKER_TIMEOUT_S = 360   # a hang guard: the 2-device worker takes ~130 s cold alone on 2 cores, more beside another
COLLECTIVE = re.compile(r"all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter")


def run_worker(num_devices: int) -> dict:
    out = subprocess.run([sys.executable, WORKER, str(num_devices)], capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp2():
    return run_worker(2)


@pytest.fixture(scope="module")
def tp4():
    return run_worker(4)


def assert_same_outputs(one: dict, many: dict):
    """Greedy tokens identical; logprobs equal but for the order of the all-reduce sums. f32 sums reordered over a
    30-layer model move a logprob by a few parts in 1e6 of its size: atol for the small ones, rtol for the tail
    (-24.38 moved by 2e-4 at TP3 on a 2-core x86 CPU)."""
    assert many["tokens"] == one["tokens"]
    np.testing.assert_allclose(np.concatenate(many["logprobs"]), np.concatenate(one["logprobs"]), rtol=2e-5,
                               atol=1e-4)


@pytest.mark.slow
def test_tp2_greedy_tokens_and_logprobs_match_one_device(tp2):
    assert_same_outputs(tp2["tiny"]["1"], tp2["tiny"]["2"])


@pytest.mark.slow
def test_tp2_mixture_of_experts_matches_one_device(tp2):
    """Expert parallelism: attention split on heads, the experts on experts (each device runs the tokens' pairs
    routed to its own, an all-reduce sums them); every parameter placed as param_spec says."""
    assert_same_outputs(tp2["moe"]["1"], tp2["moe"]["2"])
    assert tp2["moe"]["placement"]["wrong_params"] == []


@pytest.mark.slow
def test_tp2_with_fewer_kv_heads_than_devices_matches_one_device(tp2):
    """4 q heads, 1 kv head: the projections stay whole and each device keeps its own copy of the kv head."""
    assert_same_outputs(tp2["mqa"]["1"], tp2["mqa"]["2"])


@pytest.mark.slow
def test_tp2_speculative_decoding_n_gram_draft_model_and_eagle3_match_one_device_without_it(tp2):
    spec = tp2["speculative"]
    assert spec["2"]["tokens"] == spec["1"]["tokens"] and spec["2"]["accepted"] > 0
    assert spec["draft"]["tokens"] == spec["1"]["tokens"] and spec["draft"]["accepted"] > 0
    assert spec["eagle3"]["tokens"] == spec["1"]["tokens"] and spec["eagle3"]["drafted"] > 0


@pytest.mark.slow
def test_tp4_and_smollm_at_tp3_match_one_device(tp4):
    """TP4 on 2 kv heads (each held by two devices), and the embedded SmolLM2 (9 q / 3 kv heads) split 3 ways."""
    assert_same_outputs(tp4["tiny"]["1"], tp4["tiny"]["4"])
    assert_same_outputs(tp4["smollm"]["1"], tp4["smollm"]["3"])


@pytest.mark.slow
def test_tp2_places_every_parameter_and_the_cache_split(tp2):
    placed = tp2["placement"]
    assert placed["wrong_params"] == [] and placed["cache_spec_ok"] and placed["replicated"]
    assert placed["cache_shape"][2] == TINY.num_kv_heads and placed["cache_shard_shape"][2] == TINY.num_kv_heads // 2


@pytest.mark.slow
def test_tp2_model_graph_moves_only_activations(tp2):
    """One all-reduce for the embedding lookup and one after each row-parallel matmul (o, down), all of [T, H];
    one all-gather of the [S, V] logits. Never the weights or the cache."""
    ops = sorted((op, re.search(r"\[(.*)\]", shape).group(1)) for shape, op in tp2["collectives"])
    assert ops == [("all-gather", f"4,{TINY.vocab_size}")] + [("all-reduce", f"16,{TINY.hidden_size}")] * (
        1 + 2 * TINY.num_layers)


@pytest.mark.slow
def test_tp2_copy_on_write_and_prefix_hits_match_one_device(tp2):
    one, two = tp2["cow"]["1"], tp2["cow"]["2"]
    assert two["copies"] == one["copies"] > 0 and two["prefix_hits"] == one["prefix_hits"] > 0
    assert two["first"]["tokens"] == one["first"]["tokens"] and two["again"]["tokens"] == one["again"]["tokens"]
    assert all(t == one["first"]["tokens"][0] for t in two["first"]["tokens"] + two["again"]["tokens"])


@pytest.mark.slow
def test_tp2_precompile_covers_every_graph(tp2):
    assert tp2["precompiled"]["compiles_after_start"] == 0


def test_tp1_graph_is_the_one_device_graph():
    """No shard_map and no collectives at tp=1: the code path compiles to what it did before meshes."""
    llm = LLM(random_model(TINY, jnp.float32), **{**KNOBS, "num_blocks": 64, "precompile": False})
    graphs = llm.engine.graphs
    lowered = graphs.lower(graphs.model_key(16, 4, False))
    assert "manual_computation" not in lowered.as_text() and not COLLECTIVE.search(lowered.compile().as_text())


def test_tensor_parallel_size_is_a_checked_knob_of_config_and_cli(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tensor_parallel_size=0)
    config = tmp_path / "tp.yaml"
    config.write_text("engine:\n  tensor_parallel_size: 2\n")
    assert load_run_config(config).engine.tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "--config", str(config), "--tensor-parallel-size", "4"])
    assert served_engine_config(args).tensor_parallel_size == 4
    assert build_parser().parse_args(["generate", "--tensor-parallel-size", "2", "hi"]).tensor_parallel_size == 2


def test_a_mesh_that_is_not_the_configs_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but the model was loaded on 1 device"):
        LLM(random_model(TINY, jnp.float32), **{**KNOBS, "num_blocks": 64, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 needs that many devices; {len(jax.devices())}"):
        load_run(tensor_parallel_size=2)


def test_models_tp_cannot_split_are_refused_naming_the_shape():
    check_tensor_parallel(TINY, 2)
    with pytest.raises(ValueError, match="does not divide the model's num_heads=9"):   # SmolLM2 at tp=2
        check_tensor_parallel(replace(TINY, num_heads=9, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="must divide the model's num_kv_heads=3 or be a multiple of it"):
        check_tensor_parallel(replace(TINY, num_heads=6, num_kv_heads=3), 2)
    moe = replace(TINY, arch="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
    check_tensor_parallel(moe, 2)
    with pytest.raises(ValueError, match="does not divide the model's num_experts=6"):   # whole experts per device
        check_tensor_parallel(moe, 4)


def test_param_spec_is_megatron_style():
    attn = ("layers", 0, "self_attn")
    assert param_spec((*attn, "q_proj", "kernel"), 2, True, True) == P(None, "tp")
    assert param_spec((*attn, "q_proj", "bias"), 1, True, True) == P("tp")
    assert param_spec((*attn, "o_proj", "kernel"), 2, True, True) == P("tp", None)
    assert param_spec((*attn, "k_proj", "kernel"), 2, False, True) == P()   # kv heads fewer than devices
    assert param_spec(("embed_tokens", "embedding"), 2, True, True) == P("tp", None)
    assert param_spec(("lm_head", "kernel"), 2, True, False) == P()         # vocab tp does not divide
    assert param_spec(("norm", "weight"), 1, True, True) == P(None)
    moe = ("layers", 1, "mlp")
    assert param_spec((*moe, "experts", "down_proj"), 3, True, True) == P("tp", None, None)   # whole experts
    assert param_spec((*moe, "gate", "kernel"), 2, True, True) == P(None, None)   # the router: every device's
    assert cache_kv_heads(8, 2) == 8 and cache_kv_heads(2, 8) == 8


def test_a_step_traced_on_its_mesh_knows_how_many_devices_run_it(monkeypatch):
    """The single-device kernels ask on_one_device: the traced step's mesh where one is given (a data-parallel
    replica holds one device of several), the host's devices otherwise."""
    monkeypatch.setattr(jax, "device_count", lambda *_: 4)
    assert not on_one_device()
    with traced_on(make_mesh(1)):
        assert on_one_device()
        with traced_on(None):   # a call with no mesh of its own runs where the enclosing step runs
            assert on_one_device()
        with traced_on(SimpleNamespace(size=2)):
            assert not on_one_device()
    assert not on_one_device()
