"""Cascade attention against plain decode attention, kernel level: decode-only batches whose rows share a prefix.

Each point is G groups x M members sharing `shared` tokens (whole blocks), each member `own` more tokens of its own,
Llama-3-8B heads (32 q / 8 kv / 128), bf16, block size 16, pages in random order. `plain` is the one-launch decode
kernel reading every row's whole context; `cascade` is the shared pass plus the decode launch over the rows' own
keys. `ms` is GPU time (benchmarks/common.device_busy_ms, median of 10); `gbps` counts the KV bytes a prefix-once
read needs (shared once per group, own per row), the same bytes for both impls, so it compares them directly.
`--threshold` sweeps one group of M members over shared lengths: where cascade starts to pay sets
step_graphs.CASCADE_MIN_MEMBERS and CASCADE_MIN_SAVED_KEYS. `--own-sweep` sweeps 256 members' own keys against
their shared ones: where the CUDA call reads the own keys its plain decode also takes the shared pages from L2, so
the own keys decide where cascade pays. `--programs N ...` adds a cascade row per value of
Tuning.cascade_programs (the shared pass's program budget, which sets its splits of the shared keys). `--mosaic`
adds both on the Mosaic GPU decode kernel (Hopper; decode_backend="mosaic"): plain_mosaic and cascade_mosaic,
once per `--mosaic-variants` Tuning override (default: the defaults alone); where the CUDA library loads, also
plain_cuda (the CUDA call's decode) and cascade_mosaic_cuda (the rows' own keys through the CUDA call, as the engine
runs a cascade step on Hopper from CUDA_DECODE_MIN_ROWS rows).

  python benchmarks/cascade.py                 # the engine's shapes: 256 x 1024 shared, n = 8 over 32 prompts
  python benchmarks/cascade.py --threshold     # where cascade starts to pay
  python benchmarks/cascade.py --mosaic --own-sweep   # the same against the own keys (Hopper, the CUDA call)
  python benchmarks/cascade.py --programs 128 264 528 1056   # tune the shared pass's splits
  python benchmarks/cascade.py --mosaic        # the Mosaic GPU kernels' rows beside Triton's, same run (Hopper)
  python benchmarks/cascade.py --mosaic --mosaic-variants '[{}, {"mosaic_decode_warpgroups": 2}]'
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_calls  # noqa: E402
from benchmarks.common import device_busy_ms, kernel_profile, time_ms, write_rows  # noqa: E402
from jaxserve.engine.step_inputs import cascade_inputs, share_prefixes  # noqa: E402
from pallas_kernels.cascade_attention import cascade_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
# (groups, members, shared, own, rows): "adjacent" lays a group's members side by side as the engine does (n > 1
# samples are consecutive rows), "shuffled" scatters them, which denies plain decode the L2 hits of its neighbours
ENGINE_POINTS = [(1, 256, 1024, 64, "adjacent"), (1, 256, 1024, 192, "adjacent"), (32, 8, 1024, 64, "adjacent"),
                 (32, 8, 1024, 64, "shuffled"), (1, 64, 1024, 128, "adjacent"), (1, 8, 1024, 128, "adjacent"),
                 (1, 256, 512, 512, "adjacent")]
# largest groups first: they set the rule, and a sweep cut short by its time limit still has them
THRESHOLD_POINTS = [(1, m, s, 64, "adjacent") for m in (256, 128, 64, 32, 8) for s in (256, 512, 1024, 2048)]
OWN_SWEEP_POINTS = [(1, 256, s, o, "adjacent") for s in (1024, 512) for o in (128, 256, 384, 512, 1024)]


def make_batch(rng, groups: int, members: int, shared: int, own: int, rows_order: str):
    """q, caches, kv_lens, block tables and num_seqs of G x M rows, groups in a random order, members as
    `rows_order` says."""
    rows, shared_blocks, own_blocks = groups * members, shared // BLOCK, -(-own // BLOCK)
    width = shared_blocks + own_blocks
    pages = rng.permutation(np.arange(1, groups * shared_blocks + rows * own_blocks + 1)).astype(np.int32)
    tables = np.zeros((rows, width), np.int32)
    heads, tails = np.split(pages, [groups * shared_blocks])
    tables[:, :shared_blocks] = np.repeat(heads.reshape(groups, shared_blocks), members, axis=0)
    tables[:, shared_blocks:] = tails.reshape(rows, own_blocks)
    order = (rng.permutation(rows) if rows_order == "shuffled" else
             (rng.permutation(groups)[:, None] * members + np.arange(members)).reshape(-1))
    num_pages = len(pages) + 1
    k, v = (jnp.asarray(rng.standard_normal((num_pages, BLOCK, KV_HEADS, HEAD_DIM)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
    kv_lens = np.full(rows, shared + own, np.int32)
    return q, k, v, kv_lens, tables[order], np.array([rows], np.int32)


def prefix_once_bytes(groups: int, members: int, shared: int, own: int) -> int:
    return (groups * shared + groups * members * own) * KV_HEADS * HEAD_DIM * 2 * 2


def measure(fn, *args) -> tuple[float, float]:
    """(GPU ms, wall ms): the GPU time where a profile holds one, else wall."""
    wall = time_ms(fn, *args)
    busy = device_busy_ms(fn, *args)
    return (float(np.median(busy)) if busy else wall), wall


def run_point(rng, point, interpret: bool, programs: list[int | None], profile: bool,
              mosaic_variants: list[dict]) -> list[dict]:
    groups, members, shared, own, rows_order = point
    q, k, v, kv_lens, tables, num_seqs = make_batch(rng, *point)
    found = share_prefixes(tables, kv_lens, BLOCK, max_groups=64)
    cascade = jax.tree.map(jnp.asarray, cascade_inputs(found, len(kv_lens), 64))
    cu = jnp.arange(len(kv_lens) + 1, dtype=jnp.int32)
    opts = dict(sm_scale=HEAD_DIM ** -0.5, impl="pallas", interpret=interpret)
    plain = jax.jit(functools.partial(ragged_paged_attention, decode_only=True, **opts))
    args = (q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(num_seqs))
    expected = plain(q, k, v, cu, *args[3:])
    params = {"groups": groups, "members": members, "shared": shared, "own": own, "rows": rows_order,
              "found_groups": len(found), "dtype": "bfloat16", "q_heads": Q_HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "block": BLOCK}
    nbytes = prefix_once_bytes(groups, members, shared, own)
    ms, wall = measure(plain, q, k, v, cu, *args[3:])
    rows = [{"bench": "cascade", "impl": "plain", "params": params, "ms": ms, "wall_ms": wall,
             "gbps": nbytes / ms / 1e6}]
    for n in programs:
        tuning = {} if n is None else {"cascade_programs": n}
        cascaded = jax.jit(functools.partial(cascade_attention, **opts, **tuning))
        error = float(jnp.max(jnp.abs(cascaded(*args, cascade).astype(jnp.float32) - expected.astype(jnp.float32))))
        ms, wall = measure(cascaded, *args, cascade)
        rows.append({"bench": "cascade", "impl": "cascade", "params": {**params, **tuning}, "ms": ms,
                     "wall_ms": wall, "gbps": nbytes / ms / 1e6, "max_abs_err_vs_plain": error})
        print(f"G{groups} x M{members} ({rows_order}) shared {shared} own {own}: plain {rows[0]['ms'] * 1e3:.1f} us, "
              f"cascade{'' if n is None else f'[{n} programs]'} {ms * 1e3:.1f} us ({rows[0]['ms'] / ms:.2f}x), "
              f"max |diff| {error:.2g}", flush=True)
        if profile:   # where a cascade's GPU time goes: the shared pass beside the decode launch
            for name, kernel_ms, count in kernel_profile(cascaded, *args, cascade, top=4):
                print(f"    {kernel_ms * 1e3:8.1f} us x{count} {name[:90]}", flush=True)
    cuda = [("plain_cuda", lambda q, k, v, kv_lens, tables, _: custom_calls.paged_decode_attention(
                q, k, v, kv_lens, tables, sm_scale=opts["sm_scale"]), args),
            ("cascade_mosaic_cuda", functools.partial(cascade_attention, **opts, decode_backend="mosaic",
                                                      own_partials=custom_calls.paged_decode_partials),
             (*args, cascade))] if mosaic_variants and custom_calls.available() else []
    for variant in mosaic_variants:
        on_mosaic = {**opts, **variant, "decode_backend": "mosaic"}
        for impl, fn, fn_args in (
                ("plain_mosaic", functools.partial(ragged_paged_attention, decode_only=True, **on_mosaic),
                 (q, k, v, cu, *args[3:])),
                ("cascade_mosaic", functools.partial(cascade_attention, **on_mosaic), (*args, cascade)),
                *(cuda if variant == mosaic_variants[0] else [])):
            fn = jax.jit(fn)
            error = float(jnp.max(jnp.abs(fn(*fn_args).astype(jnp.float32) - expected.astype(jnp.float32))))
            ms, wall = measure(fn, *fn_args)
            rows.append({"bench": "cascade", "impl": impl, "params": {**params, **variant}, "ms": ms,
                         "wall_ms": wall, "gbps": nbytes / ms / 1e6, "max_abs_err_vs_plain": error})
            print(f"    {impl}{variant or ''} {ms * 1e3:.1f} us ({rows[0]['ms'] / ms:.2f}x plain), "
                  f"max |diff| {error:.2g}", flush=True)
            if profile and impl.startswith("cascade"):
                for name, kernel_ms, count in kernel_profile(fn, *fn_args, top=6):
                    print(f"        {kernel_ms * 1e3:8.1f} us x{count} {name[:90]}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", action="store_true", help="one group of M members over shared lengths")
    parser.add_argument("--own-sweep", action="store_true", help="256 members over own against shared lengths")
    parser.add_argument("--programs", type=int, nargs="+", default=[None],
                        help="Tuning.cascade_programs values, a cascade row each (default: the tuned default)")
    parser.add_argument("--profile", action="store_true", help="print each cascade's kernels by GPU time")
    parser.add_argument("--mosaic", action="store_true", help="plain and cascade on the Mosaic GPU decode kernel too")
    parser.add_argument("--mosaic-variants", metavar="JSON", default="[{}]",
                        help="--mosaic: a JSON list of Tuning overrides, their rows each")
    parser.add_argument("--points", type=int, nargs="+", metavar="I", help="only these points of the list (indices)")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/cascade_<backend>.json)")
    args = parser.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    if args.mosaic and interpret:   # interpreted under jit, Mosaic GPU kernels deadlock on the CPU client
        parser.error("--mosaic needs a Hopper GPU (the Mosaic GPU kernels are tested interpreted: tests/)")
    rng = np.random.default_rng(0)
    points = THRESHOLD_POINTS if args.threshold else OWN_SWEEP_POINTS if args.own_sweep else ENGINE_POINTS
    variants = json.loads(args.mosaic_variants) if args.mosaic else []
    rows = [r for i, point in enumerate(points) if args.points is None or i in args.points
            for r in run_point(rng, point, interpret, args.programs, args.profile, variants)]
    command = "python benchmarks/cascade.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_rows(args.out or f"benchmarks/results/cascade_{jax.default_backend()}.json", rows, command)


if __name__ == "__main__":
    main()
