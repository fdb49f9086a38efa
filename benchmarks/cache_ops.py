"""KV-cache writes and block copies: XLA (what the engine runs) against the CUDA custom calls, same process.

Llama-3-8B cache: 32 layers, 8 kv heads, head_dim 128, bf16, block 16; --num-blocks sizes it (default 2048 =
4 GiB of K+V over all layers). --small (automatic on CPU): 2 layers, 2 kv heads, 1024 blocks (16 MiB).
  write  xla-scatter (jaxserve.cache.kv_cache.write_kv) vs cuda-reshape-and-cache (custom_calls.reshape_and_cache),
         every layer in one jit, num_tokens 64..4096; pattern decode (random distinct slots) or prefill (whole
         blocks in random order)
  copy   xla-copy-blocks (kv_cache.copy_blocks, the engine's call) vs cuda-copy-blocks (custom_calls.copy_blocks on
         each layer in one jit, ids padded to the same power-of-two bucket), n_pairs 1..256
Caches are donated and threaded through the calls as in the engine. Before timing, both impls run once from the
same random cache and must leave bit-identical caches (else exit 1). `ms`: GPU busy time (common.device_busy_ms)
where the profiler sees a GPU, else wall time (common.time_ms); `wall_ms` is kept. `gbps`: useful bytes (new K/V
rows or source blocks, read + written) / ms. On a GPU the CUDA library must build, else exit 1 (no silent reference).

  PYTHONPATH=. JAX_PLATFORMS=cuda python benchmarks/cache_ops.py --out $OUT/cache_ops_h100.json    # one H100
  PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python benchmarks/cache_ops.py --out /tmp/cache_ops_cpu.json  # smoke
"""
import argparse
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_calls as cc  # noqa: E402
from benchmarks.common import device_busy_ms, time_ms, write_rows  # noqa: E402
from jaxserve.cache import kv_cache as kvc  # noqa: E402

TOKENS, PAIRS, DTYPE = (64, 256, 1024, 4096), (1, 16, 64, 256), jnp.bfloat16


def all_layers(write):
    """write(k_cache, v_cache, k, v, slots) on every layer in one jit, the cache donated."""
    return jax.jit(lambda cache, new, slots: [write(*kv, *kv_new, slots) for kv, kv_new in zip(cache, new)],
                   donate_argnums=0)


xla_write, cuda_write = all_layers(kvc.write_kv), all_layers(cc.reshape_and_cache)


_cuda_copy = jax.jit(lambda cache, src, dst: [cc.copy_blocks(*kv, src, dst) for kv in cache], donate_argnums=0)


def cuda_copy(cache, src, dst):
    """The engine's call shape: host ids padded to kv_cache's bucket, padding dsts out of range (skipped)."""
    n, num_blocks = len(src), cache[0][0].shape[0]
    pad = max(kvc.COPY_BUCKET_MIN, 1 << (n - 1).bit_length()) - n
    return _cuda_copy(cache, np.concatenate([src, np.zeros(pad, np.int32)]),
                      np.concatenate([dst, np.arange(num_blocks, num_blocks + pad, dtype=np.int32)]))


def random_pairs(seed, shape, layers):
    x = [jax.random.normal(k, shape, DTYPE) for k in jax.random.split(jax.random.key(seed), 2 * layers)]
    return list(zip(x[::2], x[1::2]))


def bits(x):
    return np.asarray(x).view(np.uint16)


def write_case(cfg, n, pattern, seed):
    """(inputs, useful bytes, check of layer 0 K) for n tokens: decode slots anywhere, prefill whole blocks."""
    rng, bs, nb = np.random.default_rng(seed), cfg["block_size"], cfg["num_blocks"]  # block 0: the null block
    if pattern == "decode":
        slots = bs + rng.choice((nb - 1) * bs, n, replace=False)
    else:
        slots = ((1 + rng.choice(nb - 1, n // bs, replace=False))[:, None] * bs + np.arange(bs)).ravel()
    new = random_pairs(seed, (n, cfg["kv_heads"], cfg["head_dim"]), cfg["layers"])
    k0 = new[0][0]
    written = lambda c: np.array_equal(bits(c[0][0]).reshape(-1, *k0.shape[1:])[slots], bits(k0))  # noqa: E731
    return (new, jnp.asarray(slots, jnp.int32)), 4 * cfg["layers"] * k0.nbytes, written


def copy_case(cfg, n, seed):
    blocks = 1 + np.random.default_rng(seed).choice(cfg["num_blocks"] - 1, 2 * n, replace=False).astype(np.int32)
    src, dst = blocks[:n], blocks[n:]
    copied = lambda c: np.array_equal(bits(c[0][0])[dst], bits(c[0][0])[src])  # noqa: E731
    return (src, dst), 4 * cfg["layers"] * n * cfg["block_size"] * cfg["kv_heads"] * cfg["head_dim"] * 2, copied


def check_same(impls, cfg, inputs, expect, seed, label):
    """One call of each impl from the same random cache: the caches must match bit for bit. Returns one."""
    start = random_pairs(seed, (cfg["num_blocks"], cfg["block_size"], cfg["kv_heads"], cfg["head_dim"]), cfg["layers"])
    (name_a, fn_a), (name_b, fn_b) = impls
    a = fn_a([tuple(jnp.copy(x) for x in kv) for kv in start], *inputs)
    b = fn_b(start, *inputs)
    for layer, (kv_a, kv_b) in enumerate(zip(a, b)):
        for which, x, y in zip("KV", kv_a, kv_b):
            if not np.array_equal(bits(x), bits(y)):
                sys.exit(f"MISMATCH {label}: {name_a} and {name_b} leave different layer {layer} {which} caches")
    if not expect(b):
        sys.exit(f"WRONG {label}: layer 0 K does not hold what was written/copied")
    return b


def measure(fn, cache, inputs):
    """(cache, ms, wall_ms): the cache threaded through every call, as the engine does with the donated one."""
    state = [cache]

    def step():
        state[0] = fn(state[0], *inputs)
        return state[0]
    wall = time_ms(step)
    busy = device_busy_ms(step) if jax.default_backend() == "gpu" else None
    return state[0], (float(np.median(busy)) if busy else wall), wall, "gpu-busy" if busy else "wall"


def bench_case(impls, cfg, params, case, seed, rows):
    """Check, then time both impls on one case; returns the verdict fragment."""
    inputs, nbytes, expect = case
    cache = check_same(impls, cfg, inputs, expect, seed, params)
    ms = {}
    for impl, fn in impls:
        cache, ms[impl], wall, timer = measure(fn, cache, inputs)
        rows.append({"bench": "cache_ops", "impl": impl, "params": {**params, **cfg}, "ms": ms[impl],
                     "gbps": nbytes / ms[impl] / 1e6, "wall_ms": wall, "timer": timer,
                     "bytes": nbytes, "cuda_path": "ffi" if cc.available() else "reference"})
        print(json.dumps({k: rows[-1][k] for k in ("impl", "ms", "gbps", "wall_ms")} | params), flush=True)
    (xla, t_xla), (cuda, t_cuda) = ms.items()
    winner, ratio = (cuda, t_xla / t_cuda) if t_cuda < t_xla else (xla, t_cuda / t_xla)
    return f"{' '.join(f'{k}={v}' for k, v in params.items())}: {winner} {ratio:.2f}x ({t_xla:.4f} vs {t_cuda:.4f} ms)"


def config(args) -> dict:
    small = args.small or jax.default_backend() == "cpu"
    cfg = dict(layers=2 if small else 32, kv_heads=2 if small else 8, head_dim=128, block_size=16, dtype="bfloat16",
               num_blocks=args.num_blocks or (1024 if small else 2048))
    least = max(2 * max(PAIRS), max(TOKENS) // cfg["block_size"]) + 1  # the null block is never written
    if cfg["num_blocks"] < least:
        sys.exit(f"--num-blocks must be >= {least}")
    start, reason = time.perf_counter(), cc.unavailable_reason()  # builds the CUDA library on first use
    if reason and jax.default_backend() == "gpu":
        sys.exit(f"custom_calls unavailable on this GPU: {reason}")
    gib = 4 * cfg["layers"] * cfg["num_blocks"] * cfg["block_size"] * cfg["kv_heads"] * cfg["head_dim"] / 2**30
    print(f"{jax.devices()[0].device_kind}: cache {gib:.3f} GiB {cfg}; custom calls: "
          f"{reason or 'CUDA library'} ({time.perf_counter() - start:.1f} s)", flush=True)
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny cache (automatic on CPU)")
    ap.add_argument("--num-blocks", type=int, default=None, help="blocks per layer (default 2048; 1024 small)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/cache_ops_<backend>.json)")
    args = ap.parse_args()
    cfg, rows, verdicts = config(args), [], {"write": [], "copy": []}
    write_impls = (("xla-scatter", xla_write), ("cuda-reshape-and-cache", cuda_write))
    copy_impls = (("xla-copy-blocks", kvc.copy_blocks), ("cuda-copy-blocks", cuda_copy))
    for seed, (pattern, n) in enumerate(((p, n) for p in ("decode", "prefill") for n in TOKENS), 1):
        verdicts["write"].append(bench_case(write_impls, cfg, {"pattern": pattern, "num_tokens": n},
                                            write_case(cfg, n, pattern, seed), seed, rows))
    for seed, n in enumerate(PAIRS, 100):
        verdicts["copy"].append(bench_case(copy_impls, cfg, {"n_pairs": n}, copy_case(cfg, n, seed), seed, rows))
    backend = "h100" if "H100" in jax.devices()[0].device_kind else jax.default_backend()
    write_rows(args.out or f"benchmarks/results/cache_ops_{backend}.json", rows,
               "python benchmarks/cache_ops.py " + shlex.join(sys.argv[1:]))
    for op, lines in verdicts.items():
        print(f"VERDICT {op} (faster impl, its speed-up; xla vs cuda ms): " + "; ".join(lines))


if __name__ == "__main__":
    main()
