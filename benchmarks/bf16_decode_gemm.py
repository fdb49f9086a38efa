"""bf16 decode linears: the CUDA kernel (custom_calls.bf16_linear, one launch for the weights that read one input)
against XLA's GEMMs as the engine compiles a decode step's (one a weight, no dot merger, Triton's GEMM fusions), on
the attention projections of Qwen3-30B-A3B (and its router) and the linears of Llama-3-8B, bf16 weights [K, N].

  python benchmarks/bf16_decode_gemm.py                        # GPU: 1 and 16 rows, every launch the kernel takes
  python benchmarks/bf16_decode_gemm.py --tokens 16 --no-sweep  # XLA and the kernel's default launch only

Rows: bench "bf16_decode_gemm", impl xla | kernel/auto | kernel/splits=<s>/warps_n=<w>/warp_tiles=<t>, params
{model, group, tokens, in, out: [N of each weight]}, ms of device time per launch group (timed over enough distinct
weights to pass the L2 cache) and gbps of weight bytes; benchmarks/results/bf16_decode_gemm_<backend>.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_calls  # noqa: E402
from benchmarks.common import device_busy_ms, write_rows  # noqa: E402
from jaxserve.engine.step_graphs import TRITON_GEMM_MAX_ROWS  # noqa: E402

STREAM_BYTES = 512 << 20   # weights streamed per timed run: ten times an H100's L2
# (model, group, K, N of each weight that reads the same input), as a decode step launches them
GROUPS = (("qwen3-30b-a3b", "qkv", 2048, (4096, 512, 512)), ("qwen3-30b-a3b", "o", 4096, (2048,)),
          ("qwen3-30b-a3b", "router", 2048, (128,)),
          ("llama3-8b", "qkv", 4096, (4096, 1024, 1024)), ("llama3-8b", "o", 4096, (4096,)),
          ("llama3-8b", "gate_up", 4096, (14336, 14336)), ("llama3-8b", "down", 14336, (4096,)))
# a decode step's graph: no dot merger (it would concatenate the weights every step), Triton's GEMMs at its rows
XLA_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def cases(ns: tuple[int, ...], k: int, sweep: bool):
    """(impl, fn(x, groups of weights)): XLA's GEMMs (one a weight) and the kernel (one launch a group), at its
    default launch and, with sweep, at every launch it takes."""
    assert TRITON_GEMM_MAX_ROWS >= custom_calls.DECODE_LINEAR_MAX_ROWS   # the engine's decode steps use Triton's
    xla = jax.jit(lambda x, gws: [x @ w for ws in gws for w in ws], compiler_options=XLA_OPTIONS)   # nnx.Linear's
    launches = [None] + [(splits, warps_n, tiles) for splits in (1, 2, 3, 4, 6, 8)
                         for warps_n in custom_calls.DECODE_LINEAR_WARPS_N
                         for tiles in custom_calls.DECODE_LINEAR_WARP_TILES
                         if sweep and all(n % (16 * tiles * warps_n) == 0 for n in ns)
                         and splits <= k // custom_calls.DECODE_LINEAR_CHUNK_K]
    out = [("xla", xla)]
    for launch in launches:
        name = "kernel/auto" if launch is None else "kernel/splits={}/warps_n={}/warp_tiles={}".format(*launch)
        out.append((name, jax.jit(lambda x, gws, launch=launch: [custom_calls.bf16_linear(x, ws, launch=launch)
                                                                   for ws in gws])))
    return out


def bench(tokens: int, sweep: bool) -> list[dict]:
    rows = []
    for model, group, k, ns in GROUPS:
        copies = max(1, STREAM_BYTES // (2 * k * sum(ns)))
        gws = [[jax.random.normal(jax.random.key(i * 8 + j), (k, n), jnp.bfloat16) * 0.02 for j, n in enumerate(ns)]
               for i in range(copies)]
        x = jax.random.normal(jax.random.key(1), (tokens, k), jnp.bfloat16)
        ref = [custom_calls.bf16_linear_reference(x, w).astype(jnp.float32) for w in gws[0]]
        err = max(float(jnp.max(jnp.abs(y.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                  for y, r in zip(custom_calls.bf16_linear(x, gws[0]), ref))
        params = {"model": model, "group": group, "tokens": tokens, "in": k, "out": list(ns)}
        group_rows = []
        for impl, fn in cases(ns, k, sweep):
            ms = float(np.median(device_busy_ms(fn, x, gws))) / copies
            group_rows.append({"bench": "bf16_decode_gemm", "impl": impl, "params": params, "ms": ms,
                               "gbps": 2 * k * sum(ns) / ms / 1e6})
            if not impl.startswith("kernel/splits"):
                print(f"T={tokens:3d} {model:14s} {group:8s} {impl:12s} {ms * 1e3:7.2f} us "
                      f"{group_rows[-1]['gbps']:6.0f} GB/s", flush=True)
        swept = [r for r in group_rows if r["impl"].startswith("kernel/splits")]
        if swept:
            best = min(swept, key=lambda r: r["ms"])
            print(f"T={tokens:3d} {model:14s} {group:8s} best {best['impl']} {best['ms'] * 1e3:7.2f} us "
                  f"{best['gbps']:6.0f} GB/s", flush=True)
        print(f"    kernel: max err / max |y| {err:.1e}", flush=True)
        rows += group_rows
        del gws
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--no-sweep", action="store_true", help="only XLA and the kernel's default launch")
    args = ap.parse_args(argv)
    if not custom_calls.available():
        raise SystemExit(f"bf16_decode_gemm needs the CUDA library: {custom_calls.unavailable_reason()}")
    rows = [row for tokens in args.tokens for row in bench(tokens, not args.no_sweep)]
    command = "python benchmarks/bf16_decode_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_rows(args.out or f"benchmarks/results/bf16_decode_gemm_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
