"""The FP8 linear layer (jaxserve.models.fp8.Fp8Linear: W8A16 up to fp8.W8A16_MAX_ROWS rows, else per-token
activation quantization, the e4m3 GEMM and the scales) against the bf16 linear it replaces, on Llama-3-8B's layer shapes, at decode and prefill token counts;
and the bare e4m3 GEMM with an f32 or a bf16 result (what the scaling epilogue costs).

  python benchmarks/fp8_gemm.py                 # GPU (sm_89+)
  python benchmarks/fp8_gemm.py --layers 4      # the linear layers of 4 decoder layers, as a step runs them
  python benchmarks/fp8_gemm.py --decode        # the W8A16 decode GEMMs: the CUDA kernel against XLA's
  python benchmarks/fp8_gemm.py --decode --decode-tokens 1 16   # ... at 1 and 16 rows
  python benchmarks/fp8_gemm.py --decode --over-k   # a launch's fixed cost: K swept at two N, t = F + bytes / R
Rows: bench "fp8_gemm", impl bf16 | fp8_linear | fp8_gemm_f32 | fp8_gemm_bf16, params {tokens, in, out},
ms and tflops; results benchmarks/results/fp8_gemm_<backend>.json. With --layers: bench "fp8_layers", impl
"<weights>/<XLA options>", params {tokens, layers}, ms per layer, gbps of weight bytes, and the step's costliest
GPU kernels printed. With --decode: bench "fp8_decode_gemm", impl xla | bf16 | kernel/auto |
kernel/splits=<s>/warps_n=<w>/warp_tiles=<t> | kernel/auto/live=1 (only the first row read) | for gate/up
kernel/auto/silu_product, gated/auto, gated/auto/live=1 (silu(gate) * up made in the launch), params {tokens,
group, in, out: [N of each weight]}, ms of device
time per launch group (DECODE_GROUPS, timed over enough distinct weights to pass the L2 cache) and gbps of weight
bytes, rows fp8_decode_gemm_<backend>.json. With --over-k the groups are OVER_K_GROUPS (named n<N>_k<K>), the
kernel at a few launches, and the fit of each impl's times printed: F, what a launch costs whatever it reads, and R,
the rate it streams at.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_calls  # noqa: E402
from benchmarks.common import device_busy_ms, kernel_profile, time_ms, write_rows  # noqa: E402

from jaxserve.config import load_run_config, model_config_from_hf  # noqa: E402
from jaxserve.models import fp8  # noqa: E402
from jaxserve.models.fp8 import FP8, Fp8Linear  # noqa: E402
from jaxserve.models.llama import MLP, Attention  # noqa: E402

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


# XLA options a step graph may be compiled with: its dot merger concatenates the weights of dots that share an
# operand (q, k, v; gate, up) below a size threshold, and Triton GEMM fusions compete with cuBLAS below 64 rows
XLA_OPTIONS = {"default": {}, "no_merge": {"xla_gpu_dot_merger_threshold_mb": 0},
               "no_merge_no_triton": {"xla_gpu_dot_merger_threshold_mb": 0, "xla_gpu_enable_triton_gemm": False}}
# (weights, XLA options, FP8 path: W8A16 below this many rows else W8A8, q/k/v and gate/up fused into one weight,
# W8A16 through the CUDA kernel where it runs)
LAYER_CASES = (("bf16", "default", 0, False, False), ("bf16", "no_merge_no_triton", 0, False, False),
               ("fp8", "no_merge_no_triton", 0, False, False), ("fp8", "no_merge_no_triton", 0, True, False),
               ("fp8", "no_merge", 4096, False, False), ("fp8", "no_merge", 4096, True, False),
               ("fp8", "no_merge", 16, False, True), ("fp8", "no_merge", 16, True, True),
               ("fp8", "no_merge_no_triton", 4096, False, False))


def layer_stack(quantization, layers: int, fused: bool):
    """(fn(state, x, positions), state): the linear layers of `layers` Llama-3-8B decoder layers (q, k, v and o
    projections, gate, up and down; attention itself left out), q/k/v and gate/up as one weight each if fused."""
    cfg = model_config_from_hf(load_run_config("configs/llama3-8b-random.yaml").random_model)
    rngs = nnx.Rngs(0)
    if fused:
        h, qkv, i = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.intermediate_size
        stack = nnx.List([nnx.List([Fp8Linear(h, qkv, use_bias=False, dtype=jnp.bfloat16, rngs=rngs),
                                    Fp8Linear(h, h, use_bias=False, dtype=jnp.bfloat16, rngs=rngs),
                                    Fp8Linear(h, 2 * i, use_bias=False, dtype=jnp.bfloat16, rngs=rngs),
                                    Fp8Linear(i, h, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)])
                          for _ in range(layers)])
    else:
        stack = nnx.List([nnx.List([Attention(cfg, jnp.bfloat16, rngs, quantization),
                                    MLP(cfg, jnp.bfloat16, rngs, quantization)]) for _ in range(layers)])
    graphdef, state = nnx.split(stack)

    def run(state, x, positions):
        for layer in nnx.merge(graphdef, state):
            if fused:
                qkv, o, gate_up, down = layer
                q, kv = jnp.split(qkv(x), [cfg.hidden_size], axis=-1)
                x = x + o(q) + kv.mean().astype(x.dtype)
                gate, up = jnp.split(gate_up(x), 2, axis=-1)
                x = x + down(jax.nn.silu(gate) * up)
            else:
                attn, mlp = layer
                q, k, v = attn.project(x, positions)
                x = x + attn.o_proj(q.reshape(x.shape[0], -1)) + (k.mean() + v.mean()).astype(x.dtype)
                x = x + mlp(x)
        return x
    return run, state


def bench_layers(layers: int) -> list[dict]:
    rows = []
    for tokens in (16, 64, 256):
        x = jax.random.normal(jax.random.key(1), (tokens, 4096), jnp.bfloat16)
        positions = jnp.arange(tokens, dtype=jnp.int32)
        for weights, option, w8a16_rows, fused, kernel in LAYER_CASES:
            if kernel and tokens > w8a16_rows:
                continue
            fp8.W8A16_MAX_ROWS, fp8.W8A16_KERNEL = w8a16_rows, kernel   # read when the layers trace, below
            run, state = layer_stack(None if weights == "bf16" else weights, layers, fused)
            fn = jax.jit(run, compiler_options=XLA_OPTIONS[option])
            ms = time_ms(fn, state, x, positions) / layers
            kernels = [k for k in kernel_profile(fn, state, x, positions, top=1000) if not k[0].startswith("<")]
            busy_ms = sum(k_ms for _, k_ms, _ in kernels) / layers
            nbytes = sum(a.nbytes for a in jax.tree.leaves(state)) / layers
            path = ("/w8a16_kernel" if kernel else "/w8a16") if weights == "fp8" and w8a16_rows else ""
            impl = f"{weights}{path}{'/fused' if fused else ''}/{option}"
            rows.append({"bench": "fp8_layers", "impl": impl, "params": {"tokens": tokens, "layers": layers},
                         "ms": ms, "device_ms": busy_ms, "launches": sum(c for *_, c in kernels) / layers,
                         "gbps": nbytes / busy_ms / 1e6 if busy_ms else None})
            print(f"T={tokens:4d} {impl:36s} {ms * 1e3:7.1f} us/layer, GPU {busy_ms * 1e3:7.1f} us "
                  f"({rows[-1]['launches']:.0f} kernels, {rows[-1]['gbps'] or 0:5.0f} GB/s)", flush=True)
            if tokens == 16:
                for name, k_ms, count in kernels[:6]:
                    print(f"    {k_ms * 1e3 / layers:8.1f} us/layer x{count:3d} {name[:110]}", flush=True)
            del state
    return rows


DECODE_STREAM_BYTES = 512 << 20   # weights streamed per timed run: ten times the H100's L2
# Llama-3-8B's decode GEMMs as a step launches them: (name, K, N of each weight that reads the same input)
DECODE_GROUPS = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)),
                 ("down", 14336, (4096,)), ("q", 4096, (4096,)), ("k", 4096, (1024,)), ("gate", 4096, (14336,)))


# One weight of N = 4096 (o's) and gate/up's pair, K swept: what a launch costs past its bytes
OVER_K_GROUPS = tuple((f"n{sum(ns)}_k{k}", k, ns) for ns, ks in (((4096,), (1024, 2048, 4096, 8192, 14336)),
                                                                 ((14336, 14336), (1024, 2048, 4096))) for k in ks)
OVER_K_IMPLS = ("xla", "bf16", "kernel/auto", "kernel/auto/live=1", "kernel/splits=1/warps_n=1/warp_tiles=2",
                "kernel/splits=2/warps_n=1/warp_tiles=2", "kernel/splits=4/warps_n=1/warp_tiles=2",
                "kernel/splits=1/warps_n=2/warp_tiles=2")


def decode_cases(ns: tuple[int, ...]):
    """(impl, fn(x, groups of weights, groups of scales)): XLA's GEMMs (one a weight), bf16's, and the kernel (one
    launch a group) at its default launch and at every launch it takes; for gate and up also the kernel followed
    by XLA's silu product and the gated launch that makes it."""
    dims = (((1,), (1,)), ((), ()))
    xla = jax.jit(lambda x, gws, gss: [custom_calls.fp8_linear_reference(x, w, s)
                                       for ws, ss in zip(gws, gss) for w, s in zip(ws, ss)],
                  compiler_options=XLA_OPTIONS["no_merge"])
    bf16 = jax.jit(lambda x, gws, gss: [jax.lax.dot_general(x, w, dims) for ws in gws for w in ws])
    cases = [("xla", xla), ("bf16", bf16)]
    launches = [None] + [(splits, warps_n, tiles) for splits in (1, 2, 4, 8)
                         for warps_n in custom_calls.DECODE_LINEAR_WARPS_N
                         for tiles in custom_calls.DECODE_LINEAR_WARP_TILES
                         if all(n % (16 * tiles * warps_n) == 0 for n in ns)]
    for launch in launches:
        name = "kernel/auto" if launch is None else "kernel/splits={}/warps_n={}/warp_tiles={}".format(*launch)
        cases.append((name, jax.jit(lambda x, gws, gss, launch=launch: [
            custom_calls.fp8_linear(x, ws, ss, launch=launch) for ws, ss in zip(gws, gss)])))
    cases.append(("kernel/auto/live=1", jax.jit(lambda x, gws, gss: [   # a batch-1 step's one real row
        custom_calls.fp8_linear(x, ws, ss, live=jnp.int32(1)) for ws, ss in zip(gws, gss)])))
    if len(ns) == 2 and ns[0] == ns[1]:   # gate and up: their product after the launch, or made in it (gated)
        cases.append(("kernel/auto/silu_product", jax.jit(lambda x, gws, gss: [
            jax.nn.silu(g) * u for ws, ss in zip(gws, gss) for g, u in [custom_calls.fp8_linear(x, ws, ss)]])))
        for name, live in (("gated/auto", None), ("gated/auto/live=1", jnp.int32(1))):
            cases.append((name, jax.jit(lambda x, gws, gss, live=live: [
                custom_calls.fp8_gated_linear(x, ws[0], ss[0], ws[1], ss[1], live=live) for ws, ss in zip(gws, gss)])))
    return cases


def bench_decode(tokens: int = 16, groups=DECODE_GROUPS, impls=None) -> list[dict]:
    """The W8A16 GEMMs of a decode step of `tokens` rows (the smallest bucket's), device time per group, each run
    streaming DECODE_STREAM_BYTES of distinct weights (bf16: as many bf16 weights); the kernel's largest error
    against XLA's, and its best launch, printed. impls: the cases to time (default all)."""
    rows = []
    for name, k, ns in groups:
        copies = max(1, DECODE_STREAM_BYTES // (k * sum(ns)))
        gws, gss = zip(*(zip(*(fp8.quantize_weight(jax.random.normal(jax.random.key(i * 8 + j), (n, k), jnp.bfloat16)
                                                   * 0.02) for j, n in enumerate(ns))) for i in range(copies)))
        x = jax.random.normal(jax.random.key(1), (tokens, k), jnp.bfloat16)
        errs = [jnp.max(jnp.abs(y.astype(jnp.float32) - custom_calls.fp8_linear_reference(x, w, s)))
                / jnp.max(jnp.abs(custom_calls.fp8_linear_reference(x, w, s).astype(jnp.float32)))
                for y, w, s in zip(custom_calls.fp8_linear(x, gws[0], gss[0]), gws[0], gss[0])]
        cases = [c for c in decode_cases(ns) if impls is None or c[0] in impls]
        for impl, fn in cases:
            weights = [[w.astype(jnp.bfloat16) for w in ws] for ws in gws] if impl == "bf16" else list(gws)
            ms = float(np.median(device_busy_ms(fn, x, weights, list(gss)))) / copies
            del weights
            nbytes = k * sum(ns) * (2 if impl == "bf16" else 1)
            rows.append({"bench": "fp8_decode_gemm", "impl": impl,
                         "params": {"tokens": tokens, "group": name, "in": k, "out": list(ns)},
                         "ms": ms, "gbps": nbytes / ms / 1e6})
            if not impl.startswith("kernel/splits"):   # auto, live=1, XLA, bf16, gated
                print(f"T={tokens:3d} {name:8s} {impl:12s} {ms * 1e3:7.2f} us {rows[-1]['gbps']:6.0f} GB/s"
                      f"{f'  (kernel: max err / max |y| {max(map(float, errs)):.1e})' if impl == 'xla' else ''}",
                      flush=True)
        best = min((r for r in rows[-len(cases):] if r["impl"].startswith("kernel/splits")), key=lambda r: r["ms"])
        print(f"T={tokens:3d} {name:8s} best {best['impl']} {best['ms'] * 1e3:7.2f} us {best['gbps']:6.0f} GB/s",
              flush=True)
        del gws, gss
    return rows


def print_fixed_cost(rows: list[dict]) -> None:
    """Each impl's times over K at one N fitted as t = F + bytes / R: F us a launch, R TB/s."""
    for n in sorted({sum(r["params"]["out"]) for r in rows}):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["params"]["in"] * n * (2 if impl == "bf16" else 1), r["ms"] * 1e3) for r in rows
                   if r["impl"] == impl and sum(r["params"]["out"]) == n]
            if len(pts) > 1:
                slope, f = np.polyfit(*np.array(pts).T, 1)
                print(f"N={n:5d} {impl:42s} F={f:5.2f} us  R={1e-6 / slope:5.2f} TB/s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=0, help="time the linear layers of this many decoder layers")
    ap.add_argument("--decode", action="store_true", help="time the W8A16 decode GEMM: CUDA kernel against XLA")
    ap.add_argument("--decode-tokens", type=int, nargs="+", default=[16],
                    help="rows of the decode GEMMs (16: the smallest bucket's, which a batch-1 step pads to)")
    ap.add_argument("--over-k", action="store_true", help="with --decode: OVER_K_GROUPS, the fixed cost fitted")
    args = ap.parse_args(argv)
    groups, impls = (OVER_K_GROUPS, OVER_K_IMPLS) if args.over_k else (DECODE_GROUPS, None)
    rows = bench_layers(args.layers) if args.layers else \
        [row for tokens in args.decode_tokens for row in bench_decode(tokens, groups, impls)] if args.decode else []
    if args.over_k:
        print_fixed_cost(rows)
    for tokens in () if args.layers or args.decode else TOKENS:
        for k, n in SHAPES:
            for impl, fn, fn_args in cases(tokens, k, n):
                ms = time_ms(fn, *fn_args)
                rows.append({"bench": "fp8_gemm", "impl": impl, "params": {"tokens": tokens, "in": k, "out": n},
                             "ms": ms, "tflops": 2 * tokens * k * n / ms / 1e9})
                print(f"T={tokens:5d} {k:5d}x{n:5d} {impl:14s} {ms:8.4f} ms {rows[-1]['tflops']:7.1f} TFLOP/s",
                      flush=True)
    command = "python benchmarks/fp8_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = "fp8_decode_gemm" if args.decode else "fp8_gemm"
    write_rows(args.out or f"benchmarks/results/{name}_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
