"""GPU check of custom_calls.paged_decode_attention: correctness against the pure-JAX reference at
every timed shape, then timings at B in {8, 64, 256} x ctx in {512, 4096, 16384} (bf16, Llama-3-8B
heads 32 q / 8 kv / 128, block 16) against the memory ceiling measured in the same run, plus a
num_splits sweep. Rows go to $OUT/attention_cuda.json (or --out).

    python3 benchmarks/attention_cuda_check.py [--quick]
"""
import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import custom_calls as cc  # noqa: E402
from benchmarks.common import memory_bandwidth_gbps, write_rows  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BATCHES, CONTEXTS = (8, 64, 256), (512, 4096, 16384)
SPLIT_SWEEP = {(8, 512): (1, 2, 4, 8), (8, 4096): (4, 16, 32), (8, 16384): (4, 16), (64, 512): (1, 2, 4),
               (64, 4096): (1, 2, 4), (256, 512): (1, 2)}
POOL_BYTES = 1 << 30     # small shapes rotate over this many cache bytes so L2 (50 MB) can't serve them
MAX_TABLE_SETS = 16
TARGET_LOOP_SECONDS = 0.02
MAX_CALLS = 100          # calls unrolled into one jitted function (no loop overhead between them)
REPEATS = 7
TOLERANCE = 2e-2         # bf16, relative L2 error against the f32 reference


def median_seconds(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def make_case(batch: int, ctx: int, seed: int):
    """Caches of table_sets disjoint random block sets (rotated between calls), q, full-length kv_lens."""
    blocks = ctx // BLOCK
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    table_sets = int(max(1, min(MAX_TABLE_SETS, POOL_BYTES // kv_bytes)))
    num_blocks = 1 + table_sets * batch * blocks
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (jax.random.normal(key, shape, jnp.bfloat16) for key in (kk, kv))
    pages = 1 + np.random.default_rng(seed).permutation(num_blocks - 1).astype(np.int32)
    tables = list(jnp.asarray(pages.reshape(table_sets, batch, blocks)))  # separate buffers: no slicing in the loop
    q = jax.random.normal(kq, (batch, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    return q, k_cache, v_cache, jnp.full((batch,), ctx, jnp.int32), tables, kv_bytes


def check(q, k_cache, v_cache, kv_lens, tables, num_splits) -> float:
    """Relative error of the first two sequences against the reference (all NaN-free)."""
    kw = dict(sm_scale=HEAD_DIM ** -0.5)
    out = cc.paged_decode_attention(q, k_cache, v_cache, kv_lens, tables[0], num_splits=num_splits, **kw)
    ref = cc.paged_decode_attention_reference(q[:2], k_cache, v_cache, kv_lens[:2], tables[0][:2], **kw)
    out, ref = np.asarray(out[:2], np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def time_decode(q, k_cache, v_cache, kv_lens, tables, num_splits, calls: int) -> float:
    """Seconds per call: `calls` back-to-back calls in one jitted function, rotating over the table
    sets. Each call's output is the next call's query (same shape and dtype): no two calls are
    alike, so XLA cannot merge them, and no extra kernel runs between them."""
    def run(q, k_cache, v_cache, kv_lens, tables):
        for i in range(calls):
            q = cc.paged_decode_attention(q, k_cache, v_cache, kv_lens, tables[i % len(tables)],
                                          sm_scale=HEAD_DIM ** -0.5, num_splits=num_splits)
        return q
    return median_seconds(jax.jit(run), q, k_cache, v_cache, kv_lens, tables) / calls


def row(params: dict, seconds: float, gbps: float) -> dict:
    return {"bench": "attention_cuda", "impl": "jaxserve-cuda", "params": params, "ms": seconds * 1e3, "gbps": gbps}


def bench_shape(batch: int, ctx: int, memory: float, rows: list, failures: list) -> None:
    q, k_cache, v_cache, kv_lens, tables, kv_bytes = make_case(batch, ctx, seed=batch * 100003 + ctx)
    default = cc.choose_num_splits(batch, KV_HEADS, Q_HEADS // KV_HEADS, ctx, cc.sm_count())
    for splits in sorted({default, *SPLIT_SWEEP.get((batch, ctx), ())}):
        err = check(q, k_cache, v_cache, kv_lens, tables, splits)
        if not err <= TOLERANCE:
            failures.append(f"B={batch} ctx={ctx} splits={splits}: rel err {err}")
            continue
        calls = int(np.clip(TARGET_LOOP_SECONDS / (kv_bytes / (memory * 1e9)), 4, MAX_CALLS))
        seconds = time_decode(q, k_cache, v_cache, kv_lens, tables, splits, calls)
        params = dict(batch=batch, ctx=ctx, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                      dtype="bfloat16", num_splits=splits, default_splits=splits == default)
        rows.append({**row(params, seconds, kv_bytes / seconds / 1e9), "rel_err": err, "memory_gbps": memory})
        gbps = rows[-1]["gbps"]
        print(f"B={batch:4d} ctx={ctx:6d} splits={splits:3d}{'*' if splits == default else ' '} "
              f"{seconds * 1e3:8.3f} ms {gbps:7.0f} GB/s {gbps / memory:6.1%} of memory  err {err:.1e}", flush=True)
    del q, k_cache, v_cache, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "attention_cuda.json"))
    parser.add_argument("--quick", action="store_true", help="only B=64 x ctx=4096")
    args = parser.parse_args()
    if not cc.available():
        sys.exit(f"custom_calls unavailable: {cc.unavailable_reason()}")
    memory = memory_bandwidth_gbps()
    print(f"{jax.devices()[0].device_kind}: memory ceiling {memory:.0f} GB/s, {cc.sm_count()} SMs", flush=True)
    rows = []
    failures = []
    shapes = [(64, 4096)] if args.quick else [(b, c) for b in BATCHES for c in CONTEXTS]
    for batch, ctx in shapes:
        bench_shape(batch, ctx, memory, rows, failures)
    write_rows(args.out, rows, "python3 benchmarks/attention_cuda_check.py" + (" --quick" if args.quick else ""))
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
