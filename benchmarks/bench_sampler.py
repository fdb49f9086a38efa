"""Sampler step cost in-graph: jaxserve.engine.sampler.sample on [S, V] f32 logits, per call.

Usage: python benchmarks/bench_sampler.py [out.json]   (default benchmarks/results/sampler.json)
Each timing runs REPS sample() calls inside one jit (a fori_loop), so dispatch is amortised as in the
engine's step; reported ms = median over trials / REPS.
"""
import json, subprocess, sys, time
from functools import partial

import jax, jax.numpy as jnp, numpy as np

sys.path.insert(0, ".")
from jaxserve.engine.sampler import init_penalty_state, make_sampling_tensors, sample  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402

REPS, TRIALS, VOCAB = 10, 15, 128256  # Llama-3 vocabulary
MODES = {"greedy": SamplingParams(temperature=0.0), "temperature": SamplingParams(temperature=0.7),
         "top_p": SamplingParams(temperature=0.7, top_p=0.9),
         "top_k_top_p_penalties": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                                 frequency_penalty=0.2)}


@partial(jax.jit, static_argnames="num_logprobs")
def repeated(logits, t, state, slots, mask, num_logprobs):
    def body(i, carry):
        out, st = sample(logits + i.astype(jnp.float32) * 1e-3, t, carry[1], slots, mask, num_logprobs=num_logprobs)
        return carry[0] + out.tokens, st
    return jax.lax.fori_loop(0, REPS, body, (jnp.zeros(logits.shape[0], jnp.int32), state))


def time_ms(*args, num_logprobs):
    jax.block_until_ready(repeated(*args, num_logprobs=num_logprobs))
    trials = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        jax.block_until_ready(repeated(*args, num_logprobs=num_logprobs))
        trials.append((time.perf_counter() - start) * 1e3 / REPS)
    return float(np.median(trials))


def main(path):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "jaxserve/engine/sampler.py"], capture_output=True, text=True).stdout
    rows, rng = [], np.random.default_rng(0)
    for s in (8, 64, 256):
        logits = jnp.asarray(rng.standard_normal((s, VOCAB), np.float32) * 3)
        state = init_penalty_state(s, VOCAB)
        slots, mask = jnp.arange(s, dtype=jnp.int32), jnp.ones(s, bool)
        for mode, params in MODES.items():
            t = jax.tree.map(jnp.asarray, make_sampling_tensors([params] * s, list(range(s)), [3] * s, num_rows=s))
            for k in (0, 20):
                ms = time_ms(logits, t, state, slots, mask, num_logprobs=k)
                rows.append({"bench": "sampler", "impl": "jaxserve.sample", "params": {"S": s, "V": VOCAB, "mode": mode,
                             "num_logprobs": k}, "ms": round(ms, 4), "tok_s": round(s / ms * 1e3, 1),
                             "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                             "commit": commit if commit and not dirty else "uncommitted",
                             "command": "python benchmarks/bench_sampler.py"})
                print(f"S={s:4d} {mode:22s} logprobs={k:2d} {ms:8.3f} ms", flush=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/sampler.json")
