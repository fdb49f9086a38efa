"""CPU attention: the custom call (custom_calls/paged_attention_cpu.py) against the pure-JAX reference it replaced as
the engine's CPU path, in one run, over the embedded SmolLM2's geometry (9 q heads, 3 kv heads, head_dim 64, f32,
blocks of 16): decode-only batches (B x context) and a prefill chunk over its own context. Each impl runs in one
jit over a cache of 4,096 blocks, timed as the median wall time of `--repeats` calls after warm-up; outputs compared
before timing. GB/s counts the K and V bytes read once.

  .venv/bin/python benchmarks/attention_cpu.py      # rows in benchmarks/results/attention_cpu.json
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import time_ms, write_rows  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 64, 16, 4096
DECODES = ((1, 45), (1, 512), (1, 2048), (8, 512), (32, 1024))   # (batch, context)
PREFILLS = ((256, 256), (512, 2048))   # (chunk tokens, context including them)


def batch(rng, q_lens, kv_lens):
    """q, caches, cu_q_lens, kv_lens, block tables, num_seqs: each sequence's blocks at random ids."""
    pages = [-(-n // BLOCK_SIZE) for n in kv_lens]
    ids = iter(rng.permutation(np.arange(1, NUM_BLOCKS)))
    tables = np.zeros((len(q_lens), max(pages)), np.int32)
    for i, n in enumerate(pages):
        tables[i, :n] = [next(ids) for _ in range(n)]
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = lambda: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q = jnp.asarray(rng.standard_normal((sum(q_lens), Q_HEADS, HEAD_DIM)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return (q, cache(), cache(), cu, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables),
            jnp.asarray([len(q_lens)], jnp.int32))


def measure(bench, q_lens, kv_lens, repeats, params):
    args = batch(np.random.default_rng(0), q_lens, kv_lens)
    fns = {impl: jax.jit(functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM ** -0.5, impl=impl,
                                           decode_only=bench == "decode"))
           for impl in ("cpu", "reference")}
    outs = {impl: np.asarray(fn(*args)) for impl, fn in fns.items()}
    error = float(np.abs(outs["cpu"] - outs["reference"]).max())
    assert np.isfinite(outs["cpu"]).all() and error < 1e-4, error
    kv_bytes = 2 * sum(kv_lens) * KV_HEADS * HEAD_DIM * 4
    rows = []
    for impl, fn in fns.items():
        ms = time_ms(fn, *args, repeats=repeats)
        rows.append({"bench": bench, "impl": impl, "params": params, "ms": ms, "gbps": kv_bytes / ms / 1e6,
                     "max_abs_diff": error})
        print(f"{bench:7} {impl:9} {params} {ms:9.3f} ms {kv_bytes / ms / 1e6:7.2f} GB/s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/attention_cpu.json")
    args = ap.parse_args()
    geometry = {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE}
    rows = []
    for b, ctx in DECODES:
        rows += measure("decode", [1] * b, [ctx] * b, args.repeats, {**geometry, "batch": b, "context": ctx})
    for tokens, ctx in PREFILLS:
        rows += measure("prefill", [tokens], [ctx], max(3, args.repeats // 4),
                        {**geometry, "tokens": tokens, "context": ctx})
    write_rows(args.out, rows, "python benchmarks/attention_cpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
