"""The mixture of experts' grouped GEMM (`jax.lax.ragged_dot_general` over [E, out, in] weights, rows sorted by
expert, as `jaxserve.models.llama.routed_experts` runs it) against a dense GEMM of the same FLOPs, and the whole
expert block (sort, three grouped GEMMs, scatter-add), on Qwen3-30B-A3B's expert shapes.

  python benchmarks/moe_gemm.py                      # GPU; Qwen3-30B-A3B: 128 experts of 768, top 8, hidden 2048
  python benchmarks/moe_gemm.py --tokens 1 256       # fewer points
Each point runs LAYERS layers' distinct weights in one jit (a token's experts at batch 1 fit in L2; a step's
layers do not), chained gate -> down. Rows: bench "moe_gemm", impl grouped | dense_same_flops | expert_block,
params {tokens, experts, top_k, hidden, intermediate, layers}, ms per layer (GPU busy time where the profiler
has it, else wall), tflops, and gbps of the weights the routed experts hold (grouped, expert_block).
Results: benchmarks/results/moe_gemm_<backend>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import device_busy_ms, time_ms, write_rows  # noqa: E402

from jaxserve.models.llama import EXPERT_DOT, routed_experts  # noqa: E402

LAYERS = 4


def grouped_chain(rows, gates, downs, group_sizes):
    """Per layer: rows [N, H] -> [N, I] -> [N, H] through each row's expert."""
    for gate, down in zip(gates, downs):
        dot = lambda x, w: jax.lax.ragged_dot_general(x, w, group_sizes, EXPERT_DOT,   # noqa: E731
                                                      preferred_element_type=jnp.float32).astype(x.dtype)
        rows = dot(dot(rows, gate), down)
    return rows


def dense_chain(rows, gates, downs):
    """The same FLOPs as one dense weight pair a layer."""
    for gate, down in zip(gates, downs):
        rows = (rows @ gate.T) @ down.T
    return rows


def block_chain(x, weights, experts, gates, ups, downs):
    for gate, up, down in zip(gates, ups, downs):
        x = routed_experts(x, weights, experts, gate, up, down, split=False)
    return x


def timed(fn, *args) -> tuple[float, str]:
    busy = device_busy_ms(fn, *args)
    return (float(np.median(busy)), "gpu_busy") if busy else (time_ms(fn, *args), "wall")


def point(tokens: int, e: int, k: int, h: int, i: int, key) -> list[dict]:
    keys = jax.random.split(key, 6)
    w = lambda key, shape: jax.random.normal(key, (LAYERS, *shape), jnp.bfloat16) * 0.02   # noqa: E731
    gates, ups, downs = w(keys[0], (e, i, h)), w(keys[1], (e, i, h)), w(keys[2], (e, h, i))
    x = jax.random.normal(keys[3], (tokens, h), jnp.bfloat16)
    experts = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(jax.random.split(keys[4], tokens))
    weights = jax.nn.softmax(jax.random.normal(keys[5], (tokens, k)), axis=-1)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    active = int((group_sizes > 0).sum())
    pairs = tokens * k
    params = {"tokens": tokens, "experts": e, "top_k": k, "hidden": h, "intermediate": i, "layers": LAYERS}
    flops = 2 * pairs * h * i
    expert_bytes = active * h * i * 2   # one projection of the routed experts, bf16
    cases = (("grouped", jax.jit(grouped_chain), (rows, list(gates), list(downs), group_sizes), 2, 2),
             ("dense_same_flops", jax.jit(dense_chain), (rows, list(gates[:, 0]), list(downs[:, 0])), 2, 0),
             ("expert_block", jax.jit(block_chain), (x, weights, experts, list(gates), list(ups), list(downs)), 3, 3))
    out = []
    for impl, fn, args, projections, read in cases:
        ms, timer = timed(fn, *args)
        ms /= LAYERS
        row = {"bench": "moe_gemm", "impl": impl, "params": {**params, "timer": timer}, "ms": ms,
               "tflops": projections * flops / ms / 1e9}
        if read:
            row["gbps"] = read * expert_bytes / ms / 1e6
        print(f"{tokens:5d} tokens ({active:3d} experts) {impl:17s} {ms * 1e3:9.1f} us/layer "
              f"{row['tflops']:7.2f} TFLOP/s" + (f" {row['gbps']:7.0f} GB/s" if read else ""), flush=True)
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    print(f"{jax.devices()[0].device_kind}: {LAYERS} layers a point", flush=True)
    rows = [r for t in a.tokens for r in point(t, a.experts, a.top_k, a.hidden, a.intermediate, jax.random.key(t))]
    out = a.out or f"benchmarks/results/moe_gemm_{jax.default_backend()}.json"
    write_rows(out, rows, "python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
