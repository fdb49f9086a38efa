"""One process of the two-process multi-host check in tests/test_multihost.py: a TP2 engine over one CPU device per
process (the tiny random model, f32), joined through JAX's coordination service on 127.0.0.1:PORT. Process 0 leads
(its runner publishes every step) and prints one JSON object, the outputs of REQUESTS; process 1 runs the published
steps until the stop message and prints how many it ran (process 0: how many it published). With MARKER, process 0
first plants a pickle that would create the file MARKER, were it ever unpickled, under the key of the first step (as
anyone reaching the coordination port could): the worker must reject it and run the genuine step.

  python tests/multihost_worker.py PROCESS_ID PORT [MARKER]
"""
import json
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_compilation import KNOBS, TINY  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.engine.distributed import step_key  # noqa: E402

LAZY = {**KNOBS, "num_blocks": 64, "precompile": False}
TINY_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 512, "eos_token_id": 1}   # TINY as a config.json (for `model: random`)
# Rows of every kind: short and long prompts (one longer than the token budget: chunked prefill), logprobs and
# prompt logprobs, then forks sharing a partial block (copy on write) and penalties (per-slot resets).
PROMPTS = [[2 + (i * 7 + j) % 120 for j in range(n)] for i, n in enumerate((5, 17, 33, 9, 90))]
REQUESTS = ([(p, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1)) for p in PROMPTS]
            + [(list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=6, n=3)),
               (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3,
                                           presence_penalty=0.5))])


def outputs(llm) -> dict:
    """Each output's tokens and the logprobs of its sampled tokens and of its prompt's."""
    outs = llm.generate([p for p, _ in REQUESTS], [params for _, params in REQUESTS], use_tqdm=False)
    comps = [c for o in outs for c in o.outputs]
    return {"tokens": [c.token_ids for c in comps],
            "logprobs": [[lp[t] for lp, t in zip(c.logprobs, c.token_ids)] for c in comps if c.logprobs]
            + [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
               for o in outs if o.prompt_logprobs]}


class Planted:
    """Unpickled, creates the file `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def main(process_id: int, port: int, marker: str | None = None) -> dict:
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from jaxserve import LLM
    from jaxserve.config import EngineConfig
    from jaxserve.engine import distributed
    from jaxserve.engine.llm_engine import start_device
    from jaxserve.models.loader import random_model
    from jaxserve.sharding import make_mesh

    jax.config.update("jax_num_cpu_devices", 1)
    cluster = distributed.cluster_from(f"127.0.0.1:{port}", 2, process_id)
    distributed.initialize(cluster, 2)
    loaded = random_model(TINY, jnp.float32, mesh=make_mesh(2))   # the global mesh: one device per process
    if not cluster.is_leader:
        graphs, runner, _ = start_device(loaded, EngineConfig(tensor_parallel_size=2, **LAZY))
        return {"steps": distributed.follow(cluster, runner), "fingerprint": graphs.manager.cache.fingerprint}
    llm = LLM(loaded, tensor_parallel_size=2, **LAZY)
    with distributed.leading(cluster, llm.engine.runner) as publisher:
        if marker:   # the worker waits on step 0 since the seal's barrier (a secret is set): it reads this first
            publisher.client.key_value_set_bytes(step_key(0), pickle.dumps(Planted(marker)))
            time.sleep(1)
        out = {**outputs(llm), "published": publisher.step}
    graphs = llm.engine.graphs
    return {**out, "processes": [d.process_index for d in graphs.mesh.devices.flat],
            "fingerprint": graphs.manager.cache.fingerprint}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])), flush=True)
