"""benchmarks/step_timeline.py times the engine's own async loop: the phases it reports are taken from steps that
produce what the engine produces untimed, launched on a busy or (idle_launch) an idle device (CPU, tiny random
model, no timing assertions)."""
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.step_timeline import ENQUEUE_PARTS, PHASES, timed_steps
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.models.loader import random_model

from helpers import TINY_NO_EOS as TINY

CFG = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(16, 64),
                   seq_buckets=(4,), num_blocks=64, precompile=False)


@pytest.mark.parametrize("idle_launch", [False, True])
def test_timed_steps_are_the_engines_steps(idle_launch):
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(random_model(TINY, jnp.float32), config=CFG)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()
    times = timed_steps(engine, 5, idle_launch=idle_launch)
    assert set(times) == set(PHASES + ENQUEUE_PARTS) and all(len(v) == 5 for v in times.values())
    assert all(t >= 0 for v in times.values() for t in v)
    assert all(p >= w for p, w in zip(times["period"], times["wait"]))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == expected
    assert not np.isnan([t for v in times.values() for t in v]).any()
