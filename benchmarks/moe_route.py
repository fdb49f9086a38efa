"""A MoE layer's routing: the CUDA call (`custom_calls.moe_route`: top-k, weights and the grouped GEMM's plan in
one launch, two past 128 tokens) against XLA's (`moe_route_reference`: softmax, top-k, sort, bincount, scans),
on Qwen3-30B-A3B's router (128 experts, top 8), as a chain of LAYERS routings in one jit. Per impl and token
count: GPU busy time a layer (CUPTI), the kernels a layer, and the host's dispatch of the whole jit (the call
returning, unsynced: what a step's enqueue pays for the chain), each the median of repeats after warm-up.

  python benchmarks/moe_route.py                  # GPU: 1, 16, 256, 4096 tokens, all live
  python benchmarks/moe_route.py --tokens 16 --live 1   # batch 1 in a 16-row bucket, as the engine runs it
Rows: bench "moe_route", impl cuda | xla, params {tokens, live, experts, top_k, layers}, ms (a layer), kernels,
dispatch_ms. Results: benchmarks/results/moe_route_<backend>.json.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import device_events, write_rows  # noqa: E402

import custom_calls as cc  # noqa: E402

LAYERS = 48
BLOCK_M = 64


def chain(x, logits, *, route, top_k, live):
    """LAYERS routings of `live` tokens (the rest padding), each one's logits shifted by the last one's weights (so
    none is dropped or hoisted); x is donated and returned updated, so the jit's buffers keep their addresses from
    call to call as a step's do."""
    num_live, base = jnp.asarray([live], jnp.int32), jnp.zeros((1,), jnp.int32)
    for _ in range(LAYERS):
        r = route(logits, num_live, base, top_k=top_k, renormalize=True, local_experts=logits.shape[1],
                  block_m=BLOCK_M)
        x = x + r.weights.sum() + r.pair_rows[0, 0].astype(x.dtype) + r.num_tiles[0].astype(x.dtype)
        logits = logits + x[:1].astype(logits.dtype)
    return x


def dispatch_ms(fn, x, logits, repeats=30) -> tuple[float, jax.Array]:
    """Median host time of fn(x, logits) returning (x donated: each call takes the last one's output)."""
    times = []
    for _ in range(repeats + 3):
        t = time.perf_counter()
        x = fn(x, logits)
        times.append(time.perf_counter() - t)
        x.block_until_ready()
    return float(np.median(times[3:]) * 1e3), x


def point(tokens: int, live: int, experts: int, top_k: int, impl: str) -> dict:
    route = cc.moe_route if impl == "cuda" else cc.moe_route_reference
    routings = functools.partial(chain, route=route, top_k=top_k, live=live)
    logits = jax.random.normal(jax.random.key(tokens), (tokens, experts), jnp.bfloat16)
    host, _ = dispatch_ms(jax.jit(routings, donate_argnums=0), jnp.zeros((8,), jnp.float32), logits)
    events = device_events(jax.jit(routings), jnp.zeros((8,), jnp.float32), logits, repeats=10)
    busy = sum(d for _, d, _ in events) / 1e6 / 10 if events else float("nan")
    return {"bench": "moe_route", "impl": impl,
            "params": {"tokens": tokens, "live": live, "experts": experts, "top_k": top_k, "layers": LAYERS},
            "ms": busy / LAYERS, "kernels": len(events) / 10 / LAYERS, "dispatch_ms": host}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--live", type=int, default=None, help="live tokens a point (default: all; the rest padding)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    impls = ["cuda", "xla"] if cc.available() else ["xla"]
    print(f"{jax.devices()[0].device_kind}: {LAYERS} routings a point; impls {impls}", flush=True)
    out = a.out or f"benchmarks/results/moe_route_{jax.default_backend()}.json"
    for tokens in a.tokens:
        live = min(a.live or tokens, tokens)
        rows = [point(tokens, live, a.experts, a.top_k, impl) for impl in impls]
        for r in rows:
            print(f"{tokens:5d} tokens ({live} live) {r['impl']:4s} {r['ms'] * 1e3:7.1f} us a layer, {r['kernels']:5.1f} kernels a "
                  f"layer, dispatch {r['dispatch_ms']:.2f} ms for {LAYERS}", flush=True)
        write_rows(out, rows, "python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
