"""W8A8 GEMMs at Llama-3-8B's decoder shapes (q/k/v fused, o, gate, down): custom_calls.fp8_scaled_mm (cuBLASLt's
FP8 GEMM with the per-token and per-channel scales in its epilogue, as the engine's W8A8 rows run on one GPU)
against custom_calls.fp8_mm (the same GEMM without scales, f32, the scales in a fusion after it) and XLA's FP8
GEMM with an f32 result scaled by a fusion after it (fp8_scaled_mm_reference), and bare with a bf16 result. GPU
time per GEMM, each program running distinct weights past the L2 cache.

  python benchmarks/fp8_w8a8_gemms.py 256 64     # rows of each GEMM (GPU, sm_90, the CUDA library built)
Rows: bench "fp8_w8a8_gemm", impl ovscale_call | unscaled_call | xla_f32_then_scale | xla_bf16_bare, params
{tokens, name, out, in}, ms and gbps of weight bytes; results --out (benchmarks/results/fp8_w8a8_gemm_gpu.json).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_calls  # noqa: E402
from benchmarks.common import device_busy_ms, write_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336)}   # [out, in]
STREAMED_BYTES = 600e6   # weights a program runs, past the H200's L2
DIMS = (((1,), (1,)), ((), ()))


def gemms(x_scale, w_scale) -> dict:
    """impl -> fn(xs, ws): one GEMM per (x, w) pair."""
    return {
        "ovscale_call": lambda xs, ws: [custom_calls.fp8_scaled_mm(x, x_scale, w, w_scale) for x, w in zip(xs, ws)],
        "unscaled_call": lambda xs, ws: [(custom_calls.fp8_mm(x, w) * x_scale * w_scale).astype(jnp.bfloat16)
                                         for x, w in zip(xs, ws)],
        "xla_f32_then_scale": lambda xs, ws: [custom_calls.fp8_scaled_mm_reference(x, x_scale, w, w_scale)
                                              for x, w in zip(xs, ws)],
        "xla_bf16_bare": lambda xs, ws: [jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16)
                                         for x, w in zip(xs, ws)],
    }


def bench(tokens: int, name: str, n: int, k: int) -> list[dict]:
    copies = max(2, int(STREAMED_BYTES // (n * k)))
    keys = jax.random.split(jax.random.key(n + k + tokens), 2 * copies)
    ws = [(jax.random.normal(keys[i], (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn) for i in range(copies)]
    xs = [jax.random.normal(keys[copies + i], (tokens, k), jnp.float32).astype(jnp.float8_e4m3fn)
          for i in range(copies)]
    rows = []
    for impl, fn in gemms(jnp.full((tokens, 1), 0.01, jnp.float32), jnp.full((n,), 0.02, jnp.float32)).items():
        f = jax.jit(fn)
        jax.block_until_ready(f(xs, ws))
        busy = sorted(device_busy_ms(f, xs, ws, repeats=5) or [float("nan")])
        ms = busy[len(busy) // 2] / copies
        rows.append({"bench": "fp8_w8a8_gemm", "impl": impl,
                     "params": {"tokens": tokens, "name": name, "out": n, "in": k}, "ms": ms, "gbps": n * k / ms / 1e6})
        print(f"T={tokens:4d} {name:5s} {impl:19s} {ms * 1e3:7.1f} us {rows[-1]['gbps']:7.0f} GB/s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens", nargs="*", type=int, default=[256], help="rows of each GEMM")
    ap.add_argument("--out", default="benchmarks/results/fp8_w8a8_gemm_gpu.json")
    args = ap.parse_args()
    rows = [row for t in args.tokens for name, (n, k) in SHAPES.items() for row in bench(t, name, n, k)]
    write_rows(args.out, rows, "python benchmarks/fp8_w8a8_gemms.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
