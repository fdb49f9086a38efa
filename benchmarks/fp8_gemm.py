"""The FP8 linear layer (jaxserve.models.fp8.Fp8Linear: per-token activation quantization, the e4m3 GEMM, the
scales) against the bf16 linear it replaces, on Llama-3-8B's layer shapes, at decode and prefill token counts;
and the bare e4m3 GEMM with an f32 or a bf16 result (what the scaling epilogue costs).

  python benchmarks/fp8_gemm.py                 # GPU (sm_89+)
Rows: bench "fp8_gemm", impl bf16 | fp8_linear | fp8_gemm_f32 | fp8_gemm_bf16, params {tokens, in, out},
ms and tflops; results benchmarks/results/fp8_gemm_<backend>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import time_ms, write_rows  # noqa: E402

from jaxserve.models.fp8 import FP8, Fp8Linear  # noqa: E402

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))   # q and o, k and v, gate and up, down
TOKENS = (16, 256, 4096)


def gemm(out_dtype):
    dims = (((1,), (1,)), ((), ()))
    return jax.jit(lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype))


def cases(tokens: int, k: int, n: int):
    """(impl, fn, args) for one shape."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
    w = jax.random.normal(key, (k, n), jnp.bfloat16) * 0.02
    fp8 = Fp8Linear(k, n, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(fp8)
    linear = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    xq, wq = x.astype(FP8), fp8.weight[...]
    return (("bf16", jax.jit(lambda x, w: x @ w), (x, w)), ("fp8_linear", linear, (state, x)),
            ("fp8_gemm_f32", gemm(jnp.float32), (xq, wq)), ("fp8_gemm_bf16", gemm(jnp.bfloat16), (xq, wq)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for tokens in TOKENS:
        for k, n in SHAPES:
            for impl, fn, fn_args in cases(tokens, k, n):
                ms = time_ms(fn, *fn_args)
                rows.append({"bench": "fp8_gemm", "impl": impl, "params": {"tokens": tokens, "in": k, "out": n},
                             "ms": ms, "tflops": 2 * tokens * k * n / ms / 1e9})
                print(f"T={tokens:5d} {k:5d}x{n:5d} {impl:14s} {ms:8.4f} ms {rows[-1]['tflops']:7.1f} TFLOP/s",
                      flush=True)
    command = "python benchmarks/fp8_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_rows(args.out or f"benchmarks/results/fp8_gemm_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
