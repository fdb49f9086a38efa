"""Sampler cost in-graph on [S, V] f32 logits, per call: the sort-free top-k / top-p filter at each search width P
against the sort-based filter it replaced (impls "filter_P<P>", "sort"), and jaxserve.engine.sampler.sample in the
variant the engine would pick for each parameter mix (impl "jaxserve.sample").

Usage: python benchmarks/bench_sampler.py [--quick] [--out PATH]
  default out benchmarks/results/sampler.json (rows of other devices and benches are kept: common.write_rows);
  --quick: small S and V and few repetitions, a smoke run that writes only where --out is given.
Each timing runs REPS calls inside one jit (a fori_loop, the logits nudged each time so that nothing is hoisted),
so dispatch is amortised as in the engine's step; ms = median over trials / REPS. Each filter's kept set is
checked against the sort's on the same logits.
"""
import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from benchmarks.common import write_rows  # noqa: E402
from jaxserve.engine.sampler import (filter_top_k_top_p, init_penalty_state,  # noqa: E402
                                     make_sampling_tensors, mode_for, sample)
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402

PIVOTS = (1, 3, 7, 15, 31)
TOP_K, TOP_P = 50, 0.9
MODES = {"greedy": SamplingParams(temperature=0.0), "temperature": SamplingParams(temperature=0.7),
         "top_p": SamplingParams(temperature=0.7, top_p=0.9),
         "top_k_top_p_penalties": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                                 frequency_penalty=0.2)}


def sort_top_k_top_p(logits, top_k, top_p):
    """The OLD implementation (jaxserve.engine.sampler before the sort-free filter), kept here as the peer."""
    vocab_size = logits.shape[1]
    ranked = -jnp.sort(-logits, axis=-1)
    ranked = jnp.where(jnp.arange(vocab_size) < top_k[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    num_kept = jnp.minimum(keep.sum(axis=-1), top_k)
    cutoff = jnp.take_along_axis(ranked, num_kept[:, None] - 1, axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def time_ms(step, init, args, reps, trials):
    """Median ms per call of carry = step(i, carry, *args), run reps times in one jit."""
    run = jax.jit(lambda carry, *a: jax.lax.fori_loop(0, reps, lambda i, c: step(i, c, *a), carry))
    jax.block_until_ready(run(init, *args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(run(init, *args))
        times.append((time.perf_counter() - start) * 1e3 / reps)
    return float(np.median(times))


def filter_rows(logits, reps, trials):
    s, v = logits.shape
    top_k, top_p = jnp.full(s, TOP_K, jnp.int32), jnp.full(s, TOP_P, jnp.float32)
    want = np.asarray(jax.jit(sort_top_k_top_p)(logits, top_k, top_p))
    impls = {"sort": sort_top_k_top_p} | {f"filter_P{p}": lambda x, k, q, p=p: filter_top_k_top_p(x, k, q, pivots=p)
                                          for p in PIVOTS}
    for impl, fn in impls.items():
        differ = int((np.asarray(jax.jit(fn)(logits, top_k, top_p)) != want).any(axis=-1).sum())
        ms = time_ms(lambda i, c, x, k, q, fn=fn: c + fn(x + i.astype(jnp.float32) * 1e-3, k, q).max(axis=-1),
                     jnp.zeros(s), (logits, top_k, top_p), reps, trials)
        print(f"S={s:4d} V={v} {impl:12s} {ms:8.3f} ms   rows kept differently from sort: {differ}", flush=True)
        yield {"bench": "sampler", "impl": impl, "params": {"S": s, "V": v, "top_k": TOP_K, "top_p": TOP_P},
               "ms": round(ms, 4), "tok_s": round(s / ms * 1e3, 1)}


def sample_rows(logits, reps, trials):
    s, v = logits.shape
    state, slots, mask = init_penalty_state(s, v), jnp.arange(s, dtype=jnp.int32), jnp.ones(s, bool)
    for name, params in MODES.items():
        t = jax.tree.map(jnp.asarray, make_sampling_tensors([params] * s, list(range(s)), [3] * s, num_rows=s))
        mode = mode_for([params], v)
        for k in (0, 20):
            def step(i, carry, x, t, k=k, mode=mode):
                out, st = sample(x + i.astype(jnp.float32) * 1e-3, t, carry[1], slots, mask, num_logprobs=k, mode=mode)
                return carry[0] + out.tokens, st
            ms = time_ms(step, (jnp.zeros(s, jnp.int32), state), (logits, t), reps, trials)
            print(f"S={s:4d} V={v} {name:22s} ({mode}) logprobs={k:2d} {ms:8.3f} ms", flush=True)
            yield {"bench": "sampler", "impl": "jaxserve.sample",
                   "params": {"S": s, "V": v, "mode": name, "sampler_mode": mode, "num_logprobs": k},
                   "ms": round(ms, 4), "tok_s": round(s / ms * 1e3, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small S and V, few reps: a smoke run")
    parser.add_argument("--out", help="results file (default benchmarks/results/sampler.json; none with --quick)")
    args = parser.parse_args()
    sizes, vocab, reps, trials = ((8,), 5000, 2, 3) if args.quick else ((8, 64, 256), 128256, 10, 15)  # Llama-3 V
    rows, rng = [], np.random.default_rng(0)
    for s in sizes:
        logits = jnp.asarray(rng.standard_normal((s, vocab), np.float32) * 3)
        rows += [*filter_rows(logits, reps, trials), *sample_rows(logits, reps, trials)]
    out = args.out or (None if args.quick else "benchmarks/results/sampler.json")
    if out:
        write_rows(out, rows, "python benchmarks/bench_sampler.py" + " --quick" * args.quick)


if __name__ == "__main__":
    main()
