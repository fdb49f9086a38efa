"""Tensor-parallel checks in a child process of tests/test_tensor_parallel.py: the CPU must be split into
NUM_DEVICES host devices before JAX starts, which the test process has long done. Prints one JSON object.

  python tests/tp_worker.py NUM_DEVICES

XLA:CPU admits 32 in-flight computations per device (CpuClientOptions.max_inflight_computations_per_device);
past that, multi-device programs with collectives deadlock in their rendezvous ("only 1 of them arrived", abort
after 40 s): 34 un-awaited launches of a 2-device psum hang every time, 33 never, with or without
jax_cpu_enable_async_dispatch (which covers single-device programs only). The engine keeps at most two steps,
a few programs, in flight, so it never gets there; a bare loop of sharded calls must block every < 32.
"""
import dataclasses
import json
import os
import re
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compilation import KNOBS, TINY, mixed_requests  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models.loader import load_model, random_model, save_converted  # noqa: E402
from jaxserve.models.eagle3 import save_random_eagle3  # noqa: E402
from jaxserve.sharding import KV_CACHE, TP, make_mesh, param_spec  # noqa: E402

LAZY = {**KNOBS, "num_blocks": 64, "precompile": False}
# Rows of every kind: short and long prompts, one longer than the token budget (chunked prefill), then decodes.
PROMPTS = [[2 + (i * 7 + j) % 120 for j in range(n)] for i, n in enumerate((5, 17, 33, 9, 90))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1)
# A Qwen3-MoE-shaped TINY: a dense first layer, then top-2 of 4 experts
MOE = dict(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, dense_layers=(0,))


def engine(loaded, tp: int) -> LLM:
    return LLM(loaded, tensor_parallel_size=tp, **LAZY)


def greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> dict:
    """Each output's tokens, the logprob of each sampled token and of each prompt token (the sampler's and the
    prompt-logprob graph's gathered logits)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    comps = [c for o in outs for c in o.outputs]
    return {"tokens": [c.token_ids for c in comps],
            "logprobs": [[lp[t] for lp, t in zip(c.logprobs, c.token_ids)] for c in comps if c.logprobs]
            + [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
               for o in outs if o.prompt_logprobs]}


def random_pair(tp: int, **shapes) -> dict:
    """The same random model on one device and on tp devices; where the tp engine placed its parameters."""
    cfg, out = dataclasses.replace(TINY, **shapes), {}
    for n in (1, tp):
        llm = engine(random_model(cfg, jnp.float32, mesh=make_mesh(n)), n)
        out[str(n)] = greedy(llm)
    return {**out, "placement": placement(llm)}


def placement(llm: LLM) -> dict:
    """Every parameter as param_spec places it, the cache split on kv heads, the sampler's state whole."""
    runner, mc, mesh = llm.engine.runner, llm.engine.loaded.config, llm.engine.graphs.mesh
    wrong = []
    for path, var in nnx.to_flat_state(nnx.state(llm.engine.loaded.model)):
        tp = mesh.shape[TP]
        want = param_spec(path, var.get_value().ndim, mc.num_kv_heads % tp == 0, mc.vocab_size % tp == 0)
        if var.get_value().sharding.spec != want or var.get_value().sharding.mesh != mesh:
            wrong.append(".".join(map(str, path)))
    k = runner.kv_cache[0][0]
    return {"wrong_params": wrong, "cache_spec_ok": k.sharding.spec == KV_CACHE and k.sharding.mesh == mesh,
            "cache_shape": list(k.shape), "cache_shard_shape": list(k.addressable_shards[0].data.shape),
            "replicated": all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == mesh.size
                              for x in jax.tree.leaves((runner.penalty, runner.last_tokens)))}


def copy_on_write(tp: int) -> dict:
    """Forks share a partial last block (copied on write), then the same prompt again hits the prefix cache."""
    prompt, params = [list(range(1, 20))], SamplingParams(temperature=0.0, max_tokens=6, n=3)
    out = {}
    for n in (1, tp):
        llm = engine(random_model(TINY, jnp.float32, mesh=make_mesh(n)), n)
        steps = []
        llm.engine.runner.observe_launches(steps.append)
        out[str(n)] = {"first": greedy(llm, prompt, params), "again": greedy(llm, prompt, params),
                       "copies": sum(len(s.copies[0]) for s in steps if s.copies is not None),
                       "prefix_hits": llm.engine.stats()["prefix_cache_hits"]}
    return out


def collectives(llm: LLM) -> list[str]:
    """The collectives of a compiled model graph, as "op shape"."""
    graphs = llm.engine.graphs
    hlo = graphs.lower(graphs.model_key(16, 4, False)).compile().as_text()
    return re.findall(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\(", hlo)


def precompiled(tp: int) -> dict:
    """Every graph compiles at start under tensor parallelism too."""
    llm = LLM(random_model(TINY, jnp.float32, mesh=make_mesh(tp)), tensor_parallel_size=tp,
              **{**KNOBS, "num_blocks": 64})
    llm.generate(*mixed_requests(), use_tqdm=False)
    return llm.engine.stats()


def speculative(tp: int) -> dict:
    """n-gram speculation on tp devices, beside one device without it (repetitive prompts: drafts get accepted);
    then a draft model (the model itself, saved) and a random EAGLE-3 head on tp devices."""
    prompts = [[5, 6, 7, 8, 9] * 6, [10, 11, 12] * 8 + [13]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)]
    draft = str(save_converted(random_model(TINY, jnp.float32), tempfile.mkdtemp() + "/draft"))
    head = str(save_random_eagle3(tempfile.mkdtemp() + "/eagle3", TINY, draft_vocab_size=64, aux_layers=(0, 1, 1)))
    out = {}
    for name, n, spec in (("1", 1, None), (str(tp), tp, {"num_speculative_tokens": 3}),
                          ("draft", tp, {"method": "draft", "model": draft, "num_speculative_tokens": 3}),
                          ("eagle3", tp, {"method": "eagle3", "model": head, "num_speculative_tokens": 3})):
        llm = LLM(random_model(TINY, jnp.float32, mesh=make_mesh(n)), tensor_parallel_size=n, **LAZY,
                  speculative_config=spec)
        if llm.engine.speculator is not None:   # every step it may, whatever its timings say
            llm.engine.speculator.choose = lambda bucket: True
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                     "accepted": llm.engine.stats()["spec_num_accepted_tokens"],
                     "drafted": llm.engine.stats()["spec_num_draft_tokens"]}
    return out


def run(num_devices: int) -> dict:
    if num_devices == 2:
        llm = engine(random_model(TINY, jnp.float32, mesh=make_mesh(2)), 2)
        greedy(llm)
        return {"tiny": random_pair(2), "mqa": random_pair(2, num_kv_heads=1), "moe": random_pair(2, **MOE),
                "placement": placement(llm),
                "collectives": collectives(llm), "cow": copy_on_write(2), "precompiled": precompiled(2),
                "speculative": speculative(2)}
    smollm = {str(n): greedy(engine(load_model(dtype="f32", mesh=make_mesh(n)), n), PROMPTS[:3]) for n in (1, 3)}
    return {"tiny": random_pair(4), "smollm": smollm}


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]))))
