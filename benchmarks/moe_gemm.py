"""The mixture of experts' grouped GEMM (`jax.lax.ragged_dot_general` over [E, out, in] weights, rows sorted by
expert, as `jaxserve.models.llama.routed_experts` runs it) against a dense GEMM of the same FLOPs, and the whole
expert block (routing from the router's logits, three grouped GEMMs, the weighed sum), on Qwen3-30B-A3B's expert
shapes.

  python benchmarks/moe_gemm.py                      # GPU; Qwen3-30B-A3B: 128 experts of 768, top 8, hidden 2048
  python benchmarks/moe_gemm.py --tokens 1 256       # fewer points
  python benchmarks/moe_gemm.py --tune --impls mosaic_grouped   # the Mosaic kernel's tuning variants
Each point runs LAYERS layers' distinct weights in one jit (a token's experts at batch 1 fit in L2; a step's
layers do not), chained gate -> down. Rows: bench "moe_gemm", impl grouped | dense_same_flops | expert_block,
params {tokens, experts, top_k, hidden, intermediate, layers}, ms per layer (GPU busy time where the profiler
has it, else wall), tflops, and gbps of the weights the routed experts hold (all but dense_same_flops).
On Hopper also impl mosaic_grouped (pallas_kernels/grouped_matmul_mgpu.py, gate -> down as grouped),
jax_ragged_dot_mgpu (JAX's Pallas library kernel, the same chain) and expert_block_mosaic (the block on
mosaic_grouped with the CUDA routing call, as the engine runs it there; expert_block is XLA's); a Mosaic impl that fails to build or run
records a row with its error. Elsewhere they are skipped, with the reason printed.
Results: benchmarks/results/moe_gemm_<backend>.json.
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
from benchmarks.common import device_busy_ms, time_ms, write_rows  # noqa: E402

from jaxserve.models.llama import EXPERT_DOT, routed_experts  # noqa: E402
from pallas_kernels.ragged_paged_attention import gpu_capability  # noqa: E402

LAYERS = 4


def grouped_chain(rows, gates, downs, group_sizes):
    """Per layer: rows [N, H] -> [N, I] -> [N, H] through each row's expert."""
    for gate, down in zip(gates, downs):
        dot = lambda x, w: jax.lax.ragged_dot_general(x, w, group_sizes, EXPERT_DOT,   # noqa: E731
                                                      preferred_element_type=jnp.float32).astype(x.dtype)
        rows = dot(dot(rows, gate), down)
    return rows


def mosaic_chain(rows, gates, downs, group_sizes, *, variant):
    from pallas_kernels.grouped_matmul_mgpu import GroupedTuning, grouped_matmul
    tuning = GroupedTuning(**variant, num_ctas=getattr(jax.devices()[0], "core_count", None) or 132)
    for gate, down in zip(gates, downs):
        rows = grouped_matmul(grouped_matmul(rows, gate, group_sizes, tuning=tuning), down, group_sizes, tuning=tuning)
    return rows


def jax_library_chain(rows, gates, downs, group_sizes):
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    dot = lambda x, w: ragged_dot(x, w, group_sizes=group_sizes, block_m=64, block_n=128, block_k=64,  # noqa: E731
                                  max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True)
    for gate, down in zip(gates, downs):
        rows = dot(dot(rows, gate), down)
    return rows


def dense_chain(rows, gates, downs):
    """The same FLOPs as one dense weight pair a layer."""
    for gate, down in zip(gates, downs):
        rows = (rows @ gate.T) @ down.T
    return rows


def block_chain(x, logits, num_live, gates, ups, downs, *, top_k, backend):
    for gate, up, down in zip(gates, ups, downs):
        x = routed_experts(x, logits, num_live, gate, up, down, top_k=top_k, renormalize=True, split=False,
                           backend=backend)
    return x


MOSAIC_IMPLS = {"mosaic_grouped", "jax_ragged_dot_mgpu", "expert_block_mosaic"}
TUNE_VARIANTS = ({"max_concurrent_steps": 4}, {"block_n": 64})


def max_rel_diff(out, expected) -> float:
    """max |out - expected| over max |expected|; NaN anywhere gives NaN."""
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    return float(np.abs(out - expected).max() / np.abs(expected).max())


def timed(fn, *args) -> tuple[float, str]:
    busy = device_busy_ms(fn, *args)
    return (float(np.median(busy)), "gpu_busy") if busy else (time_ms(fn, *args), "wall")


def point(tokens: int, e: int, k: int, h: int, i: int, key, impls, variants) -> list[dict]:
    keys = jax.random.split(key, 6)
    w = lambda key, shape: jax.random.normal(key, (LAYERS, *shape), jnp.bfloat16) * 0.02   # noqa: E731
    gates, ups, downs = w(keys[0], (e, i, h)), w(keys[1], (e, i, h)), w(keys[2], (e, h, i))
    x = jax.random.normal(keys[3], (tokens, h), jnp.bfloat16)
    logits, num_live = jax.random.normal(keys[4], (tokens, e), jnp.bfloat16), jnp.asarray([tokens], jnp.int32)
    flat = jax.lax.top_k(logits, k)[1].reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    active = int((group_sizes > 0).sum())
    pairs = tokens * k
    params = {"tokens": tokens, "experts": e, "top_k": k, "hidden": h, "intermediate": i, "layers": LAYERS}
    flops = 2 * pairs * h * i
    expert_bytes = active * h * i * 2   # one projection of the routed experts, bf16
    grouped_args = (rows, list(gates), list(downs), group_sizes)
    block_args = (x, logits, num_live, list(gates), list(ups), list(downs))
    cases = (("grouped", jax.jit(grouped_chain), grouped_args, 2, 2),
             ("dense_same_flops", jax.jit(dense_chain), (rows, list(gates[:, 0]), list(downs[:, 0])), 2, 0),
             ("expert_block", jax.jit(functools.partial(block_chain, top_k=k, backend="xla")), block_args, 3, 3),
             *(("mosaic_grouped", jax.jit(functools.partial(mosaic_chain, variant=v)), grouped_args, 2, 2, v)
               for v in ({}, *variants)),
             ("jax_ragged_dot_mgpu", jax.jit(jax_library_chain), grouped_args, 2, 2),
             ("expert_block_mosaic", jax.jit(functools.partial(block_chain, top_k=k, backend="mosaic")), block_args, 3,
              3))
    out = []
    for impl, fn, args, projections, read, *variant in cases:
        if impls and impl not in impls:
            continue
        if impl in MOSAIC_IMPLS and gpu_capability() != 9.0:
            print(f"{impl}: skipped, Mosaic GPU kernels need a Hopper GPU (sm_90)", flush=True)
            continue
        try:
            ms, timer = timed(fn, *args)
        except Exception as e:   # a Mosaic kernel that fails to build or run: a row, not the end of the run
            print(f"{tokens:5d} tokens {impl}: failed: {type(e).__name__}: {e}", flush=True)
            out.append({"bench": "moe_gemm", "impl": impl, "params": params, "error": f"{type(e).__name__}: {e}"})
            continue
        ms /= LAYERS
        tuning = {"tuning": variant[0] or "default"} if variant else {}
        row = {"bench": "moe_gemm", "impl": impl, "params": {**params, **tuning, "timer": timer}, "ms": ms,
               "tflops": projections * flops / ms / 1e9}
        if impl in MOSAIC_IMPLS:   # the kernels' first GPU runs: their outputs beside XLA's
            peer = dict((c[0], c) for c in cases)["expert_block" if "block" in impl else "grouped"]
            row["max_rel_diff"] = max_rel_diff(fn(*args), peer[1](*peer[2]))
        if read:
            row["gbps"] = read * expert_bytes / ms / 1e6
        print(f"{tokens:5d} tokens ({active:3d} experts) {impl:19s} {ms * 1e3:9.1f} us/layer {tuning or ''} "
              f"{row['tflops']:7.2f} TFLOP/s" + (f" {row['gbps']:7.0f} GB/s" if read else "")
              + (f" rel diff {row['max_rel_diff']:.1e}" if "max_rel_diff" in row else ""), flush=True)
        out.append(row)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--impls", nargs="+", help="only these impls")
    p.add_argument("--tune", action="store_true", help="mosaic_grouped's TUNE_VARIANTS beside its defaults")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    print(f"{jax.devices()[0].device_kind}: {LAYERS} layers a point", flush=True)
    out = a.out or f"benchmarks/results/moe_gemm_{jax.default_backend()}.json"
    for t in a.tokens:   # written point by point: a run cut short keeps what it measured
        rows = point(t, a.experts, a.top_k, a.hidden, a.intermediate, jax.random.key(t), a.impls,
                     TUNE_VARIANTS if a.tune else ())
        write_rows(out, rows, "python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
