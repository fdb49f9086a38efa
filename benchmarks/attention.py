"""Paged attention on one GPU: jaxserve's Pallas kernel against its peers, and the memory ceiling, in one run.

Llama-3-8B heads (32 q / 8 kv / 128), bf16, block size 16, pages in random order. `--kv-dtype fp8` adds our rows
over the same caches in float8 e4m3 (q and the output stay bf16) beside the bf16 ones; rows say which in
params.kv_dtype, and GB/s counts the bytes each cache holds. Impls:
  jaxserve-pallas   pallas_kernels.ragged_paged_attention (our cache layout); for decode what the engine runs
                    on a decode-only step (`decode_only=True`: one launch, split-K merged in it when the batch
                    is small); jaxserve-pallas-alt the mixed-batch path (split-K partials, a merge launch)
  jaxserve-cuda     custom_calls.paged_decode_attention (decode rows, when custom_calls.available())
  jaxserve-triton   (--mosaic-decode) the decode-only launch on each backend: Triton, and Mosaic GPU
  jaxserve-mosaic   (pallas_kernels.paged_decode_attention_mgpu) with its tuning variants
  cudnn-contiguous  jax.nn.dot_product_attention(implementation="cudnn") on a [B, ctx, kv, d] cache
  cudnn-paged       jax._src.cudnn.fused_attention_stablehlo.paged_attention on our cache (private API)
  jax-pallas-paged  jax.experimental.pallas.ops.gpu.paged_attention ([kv, pages, page, d] layout)
  xla-gather        gather each sequence's pages with XLA, then dense attention
Every output is checked against the pure-JAX reference (max_rel_err); a row that fails gets "error".
Each timing runs `calls` back-to-back calls inside one jitted program, rotating among cache copies when a
cache fits in L2 (50 MB), and reports the median over repeats divided by `calls`: `ms` is GPU busy time (the
device's kernel durations from the profiler's CUPTI records), `wall_ms` the host-timed run. Host-timed small
calls measure the harness more than the kernel: the `launch-floor` rows of --plans time one tiny XLA kernel
per call (benchmarks/NOTES_attention.md, v5).

  python benchmarks/attention.py                 # full sweep -> benchmarks/results/attention_h100.json + .png
  python benchmarks/attention.py --tune          # tuning variants at key points -> attention_tune.json
  python benchmarks/attention.py --plans         # decode paths and the CUDA call's splits, with the peers
  python benchmarks/attention.py --mosaic-decode # decode-only on each backend (Mosaic GPU, Triton), cuDNN, CUDA
  python benchmarks/attention.py --kv-dtype fp8  # any of the above with fp8-cache rows beside the bf16 ones
  python benchmarks/attention.py --mosaic-decode --kv-dtype fp8 --kv-only  # the fp8 rows alone (Triton beside)
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import commit, device_busy_ms, memory_bandwidth_gbps, write_rows  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = jnp.bfloat16
KV_DTYPES = {"bf16": DTYPE, "fp8": jnp.float8_e4m3fn}  # our kernel's caches; the peers read bf16
KV_RUNS = ["bf16"]  # the caches our rows run over, bf16 first (--kv-dtype; --kv-only: that one alone)
SM_SCALE = 1 / math.sqrt(HEAD_DIM)
L2_BYTES = 50e6
TARGET_RUN_S = 2e-3  # GPU time per timed program: long enough to hide launch and sync overhead
MAX_CALLS = 16
REPS = 10
ERR_LIMIT = 2e-2
DECODE_SWEEP = [(b, c) for b in (8, 64, 256) for c in (512, 4096, 16384)]
TUNE_POINTS = ((8, 4096), (64, 512), (64, 4096), (8, 16384), (256, 1024))
TUNE_VARIANTS = {
    "decode": [{}, {"decode_num_stages": 3}, {"decode_num_stages": 2}, {"decode_kv_tile": 32},
               {"decode_kv_tile": 32, "decode_num_stages": 6}, {"decode_programs": 264},
               {"decode_programs": 1056}, {"decode_num_warps": 2}, {"decode_kv_tile": 128},
               {"split_decode_kv_tile": 64}, {"decode_kv_tile": 128, "split_decode_kv_tile": 64},
               {"decode_kv_tile": 128, "decode_num_warps": 4}],
    "prefill": [{}, {"prefill_block_m": 64, "prefill_num_warps": 4},
                {"prefill_block_m": 64, "prefill_num_warps": 4, "prefill_kv_tile": 128},
                {"prefill_kv_tile": 128, "prefill_num_stages": 2}],
}
PLAN_POINTS = [(8, c) for c in (512, 1024, 2048, 4096, 16384)] + [(b, c) for b in (64, 256) for c in (512, 4096)]
PROFILE_POINTS = ((1, 8, 512), (1, 64, 4096), (8192, 1, 8192))  # (q_len, batch, context), for ncu


@dataclass(slots=True)
class Batch:
    """A ragged batch in our layout plus what the peers need to rebuild it."""
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    num_seqs: jax.Array
    q_lens: list
    kv_elements: int  # K and V elements the context holds: every call reads them once
    flops: float

    @property
    def kv_bytes(self) -> int:
        return self.kv_elements * self.k_cache.dtype.itemsize

    def args(self, k_cache=None, v_cache=None):
        return (self.q, self.k_cache if k_cache is None else k_cache, self.v_cache if v_cache is None else v_cache,
                self.cu_q_lens, self.kv_lens, self.block_tables, self.num_seqs)


def make_batch(key, q_lens, kv_lens) -> Batch:
    pages = [-(-n // BLOCK) for n in kv_lens]
    width = max(pages)
    num_blocks = sum(pages)  # no spare blocks: cuDNN's paged op wants exactly batch x width of them
    perm = iter(np.random.default_rng(0).permutation(num_blocks))
    tables = np.zeros((len(q_lens), width), np.int32)
    for i, n in enumerate(pages):
        tables[i, :n] = [next(perm) for _ in range(n)]
    kq, kk, kv = jax.random.split(key, 3)
    cache_shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    visible = sum(sum(min(kv - ql + j + 1, kv) for j in range(ql)) for ql, kv in zip(q_lens, kv_lens))
    return Batch(jax.random.normal(kq, (sum(q_lens), Q_HEADS, HEAD_DIM), DTYPE),
                 jax.random.normal(kk, cache_shape, DTYPE), jax.random.normal(kv, cache_shape, DTYPE),
                 jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                 jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray([len(q_lens)], jnp.int32),
                 list(q_lens), 2 * sum(kv_lens) * KV_HEADS * HEAD_DIM, 4 * visible * Q_HEADS * HEAD_DIM)


def with_kv_dtype(batch: Batch, kv_dtype: str) -> Batch:
    """`batch` over its caches stored as KV_DTYPES[kv_dtype] (the same values, rounded)."""
    dtype = KV_DTYPES[kv_dtype]
    return replace(batch, k_cache=batch.k_cache.astype(dtype), v_cache=batch.v_cache.astype(dtype))


def time_calls(fn, arg_sets):
    """(GPU ms, wall ms) per call of fn over arg_sets, all called inside one jitted program, medians over
    repeats; plus the first output. GPU time is None where the profiler sees no device stream."""
    program = jax.jit(lambda sets: [fn(*a) for a in sets])
    out = jax.block_until_ready(program(arg_sets))[0]
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        jax.block_until_ready(program(arg_sets))
        times.append(time.perf_counter() - start)
    busy = device_busy_ms(program, arg_sets, repeats=REPS)
    per_call = lambda ms: statistics.median(ms) / len(arg_sets)  # noqa: E731
    return (busy and per_call(busy)), per_call(times) * 1e3, out


def rotation(batch: Batch, per_copy_bytes: float, make_copy):
    """Arg sets for one timed program: enough calls to fill TARGET_RUN_S, cycling copies that overflow L2."""
    estimate_s = max(batch.kv_bytes / 2.5e12, batch.flops / 400e12) + 5e-6
    calls = int(np.clip(round(TARGET_RUN_S / estimate_s), 2, MAX_CALLS))
    copies = [make_copy(i) for i in range(min(calls, math.ceil(3 * L2_BYTES / per_copy_bytes)))]
    return [copies[i % len(copies)] for i in range(calls)], {"calls": calls, "copies": len(copies)}


def fresh_cache_copy(batch: Batch, i: int):
    if i == 0:
        return batch.args()
    k, v = (jax.random.normal(jax.random.key(seed + i), batch.k_cache.shape, DTYPE).astype(batch.k_cache.dtype)
            for seed in (100, 200))
    return batch.args(k, v)


def relative_error(out, expected, rows):
    out, expected = (np.asarray(x[:rows].astype(jnp.float32)) for x in (out, expected))
    return float(np.abs(out - expected).max() / np.abs(expected).max())


class Recorder:
    """Collects rows in the project's format, adding each to the results file as it comes (`write_rows`: the
    file's other rows stay) so a cut-off run keeps what it measured."""

    def __init__(self, path: str):
        self.path, self.rows, self.memory_gbps = path, [], None
        self.common = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": commit(),
                       "command": " ".join(["python"] + sys.argv)}

    def add(self, bench, impl, params, ms=None, batch: Batch | None = None, error=None, **extra):
        row = {"bench": bench, "impl": impl, "params": params}
        if error is not None:
            row["error"] = error
        elif batch is not None:
            gbps = batch.kv_bytes / ms / 1e6
            row.update(ms=ms, gbps=gbps, tflops=batch.flops / ms / 1e9,
                       pct_memory=100 * gbps / self.memory_gbps if self.memory_gbps else None)
        else:
            row["ms"] = ms
        row.update(extra)
        print(json.dumps(row), flush=True)
        write_rows(self.path, [row], self.common["command"])
        self.rows.append({**row, **self.common})

    def measure(self, bench, impl, params, fn, arg_sets, batch: Batch, expected, rotation_info):
        """Time fn, check it against the reference, record a row (or the failure)."""
        try:
            gpu_ms, wall_ms, out = time_calls(fn, arg_sets)
            error = relative_error(out, expected, sum(batch.q_lens))
        except Exception as exc:  # a peer that cannot run this shape is a row with the reason, not a crash
            self.add(bench, impl, params, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        mismatch = None if error <= ERR_LIMIT else f"output mismatch: max_rel_err {error:.3g}"
        self.add(bench, impl, {**params, **rotation_info}, gpu_ms or wall_ms, batch, error=mismatch,
                 max_rel_err=error, **timers(gpu_ms, wall_ms))

    def measure_floor(self, params, arg_sets):
        """One tiny XLA kernel per call with the same arguments: what the harness itself costs per call."""
        gpu_ms, wall_ms, _ = time_calls(lambda *a: a[0] + 1, arg_sets)
        self.add("decode", "launch-floor", {**params, "calls": len(arg_sets)}, gpu_ms or wall_ms,
                 **timers(gpu_ms, wall_ms))


def timers(gpu_ms, wall_ms) -> dict:
    """`ms` is GPU busy time when the profiler saw the device, else wall time; both are kept."""
    return {"timer": "gpu-busy" if gpu_ms else "wall", "wall_ms": wall_ms}


def measure_memory(rec: Recorder, nbytes: int = 2 << 30):
    """The memory ceiling for this run (`memory_bandwidth_gbps`); its row's ms: nbytes at that rate."""
    rec.memory_gbps = memory_bandwidth_gbps(nbytes)
    rec.add("memory", "xla-read-or-copy", {"bytes": nbytes}, nbytes / rec.memory_gbps / 1e6, gbps=rec.memory_gbps)


TUNING = {}  # overrides for every jaxserve-pallas row (--tuning)


def ours(tuning=None, decode_only=False):
    tuning = TUNING if tuning is None else tuning
    return lambda *a: ragged_paged_attention(*a, sm_scale=SM_SCALE, impl="pallas", decode_only=decode_only,
                                             **tuning)


def reference(batch: Batch):
    return ragged_paged_attention_reference(*batch.args(), sm_scale=SM_SCALE)


def cudnn_paged(q_lens, kv_lens, tables, causal):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    page_table = tables[:, None, :, None]
    return lambda q, k, v: fa.paged_attention(q, k, v, q_lens, kv_lens, page_table, page_table,
                                              scale=SM_SCALE, mask_type=mask)


def gather_attend(q, k_cache, v_cache, tables, q_pos):
    """XLA peer: gather each sequence's pages to [B, S, kv, d], then dense masked attention in f32 softmax."""
    b, s = tables.shape[0], tables.shape[1] * BLOCK
    k, v = (c[tables].reshape(b, s, KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))
    qg = q.reshape(b, -1, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * SM_SCALE
    mask = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]
    p = jax.nn.softmax(jnp.where(mask[:, None, None], logits, -jnp.inf), axis=-1).astype(DTYPE)
    return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(q.shape)


def kv_variants(batch: Batch):
    """(kv dtype, `batch` over its caches in that dtype, the reference output) for each of KV_RUNS."""
    for kv_dtype in KV_RUNS:
        converted = with_kv_dtype(batch, kv_dtype)
        yield kv_dtype, converted, reference(converted)


def bench_decode(rec: Recorder, batch_size, context, tunings=(None,)):
    bf16 = make_batch(jax.random.key(batch_size * context), [1] * batch_size, [context] * batch_size)
    for kv_dtype, batch, expected in kv_variants(bf16):
        params = {"batch": batch_size, "context": context, "kv_dtype": kv_dtype}
        sets, info = rotation(batch, batch.kv_bytes, lambda i: fresh_cache_copy(batch, i))
        for tuning in tunings:
            rec.measure("decode", "jaxserve-pallas", {**params, "tuning": tuning or TUNING or "default",
                                                      "path": "decode-only"},
                        ours(tuning, decode_only=True), sets, batch, expected, info)
        if tunings == (None,):
            rec.measure("decode", "jaxserve-pallas-alt", {**params, "path": "mixed-batch"}, ours(), sets, batch,
                        expected, info)
            if kv_dtype == "bf16":
                bench_decode_peers(rec, params, batch, expected, sets, info)


def bench_decode_peers(rec: Recorder, params, batch: Batch, expected, sets, info):
    batch_size = len(batch.q_lens)
    q4 = lambda a: (a[0][:, None], a[1], a[2])  # noqa: E731 - [B, 1, H, D] for cuDNN
    ones, lens = jnp.ones((batch_size,), jnp.int32), batch.kv_lens
    paged = cudnn_paged(ones, lens, batch.block_tables, causal=False)
    rec.measure("decode", "cudnn-paged", params, lambda *a: paged(*q4(a))[:, 0], sets, batch, expected, info)
    q_pos = (lens - 1)[:, None]
    rec.measure("decode", "xla-gather", params, lambda *a: gather_attend(*a[:3], a[5], q_pos), sets, batch,
                expected, info)
    bench_cuda_decode(rec, params, sets, batch, expected, info)
    bench_contiguous_decode(rec, params, batch, expected)
    bench_jax_paged_decode(rec, params, batch, expected)


def bench_cuda_decode(rec: Recorder, params, sets, batch: Batch, expected, info, split_choices=(None,)):
    try:
        import custom_calls
        if not custom_calls.available():
            return
    except Exception as exc:  # another engineer's module: a failure is a row, not a crash
        rec.add("decode", "jaxserve-cuda", params, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return
    for splits in split_choices:
        fn = lambda *a, n=splits: custom_calls.paged_decode_attention(a[0], a[1], a[2], a[4], a[5],  # noqa: E731
                                                                      sm_scale=SM_SCALE, num_splits=n)
        rec.measure("decode", "jaxserve-cuda", {**params, "num_splits": splits or "default"}, fn, sets, batch,
                    expected, info)


def to_contiguous(batch: Batch, k_cache, v_cache):
    b = batch.block_tables.shape[0]
    return tuple(c[batch.block_tables].reshape(b, -1, KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))


def bench_contiguous_decode(rec: Recorder, params, batch: Batch, expected):
    def copy(i):
        k, v = to_contiguous(batch, *fresh_cache_copy(batch, i)[1:3])
        return batch.q[:, None], k, v
    sets, info = rotation(batch, batch.kv_bytes, copy)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=SM_SCALE, implementation="cudnn")[:, 0]  # noqa: E731
    rec.measure("decode", "cudnn-contiguous", params, fn, sets, batch, expected, info)


def bench_jax_paged_decode(rec: Recorder, params, batch: Batch, expected):
    """JAX's Pallas paged op wants [kv, pages, page, d] and a pre-scaled q; its two best anchor configs."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    def copy(i):
        k, v = fresh_cache_copy(batch, i)[1:3]
        return (batch.q * SM_SCALE).astype(DTYPE), k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
    sets, info = rotation(batch, batch.kv_bytes, copy)
    for pages_per_block, splits in ((16, 8), (8, 16)):
        fn = lambda q, k, v, p=pages_per_block, s=splits: jax_paged.paged_attention(  # noqa: E731
            q, k, v, batch.block_tables, batch.kv_lens, block_h=16, pages_per_compute_block=p, k_splits=s)
        rec.measure("decode", "jax-pallas-paged", {**params, "pages_per_compute_block": pages_per_block,
                                                   "k_splits": splits}, fn, sets, batch, expected, info)


def bench_prefill(rec: Recorder, length, tunings=(None,)):
    """Our prefill over each KV_RUNS cache in each tuning, the peers over bf16."""
    for kv_dtype, batch, expected in kv_variants(make_batch(jax.random.key(7), [length], [length])):
        params = {"batch": 1, "context": length, "kv_dtype": kv_dtype}
        sets, info = rotation(batch, 3 * L2_BYTES, lambda i: batch.args())  # compute-bound: L2 residency is real
        for tuning in tunings:
            rec.measure("prefill", "jaxserve-pallas", {**params, "tuning": tuning or TUNING or "default"},
                        ours(tuning), sets, batch, expected, info)
        if kv_dtype == "bf16":
            bench_prefill_peers(rec, params, batch, expected, sets, info)


def bench_prefill_peers(rec: Recorder, params, batch: Batch, expected, sets, info):
    length = params["context"]
    k, v = to_contiguous(batch, batch.k_cache, batch.v_cache)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=SM_SCALE, is_causal=True,  # noqa: E731
                                                      implementation="cudnn")[0]
    rec.measure("prefill", "cudnn-contiguous", params, fn, [(batch.q[None], k, v)] * info["calls"], batch,
                expected, info)
    del k, v
    q_pos = jnp.arange(length)[None]
    rec.measure("prefill", "xla-gather", params, lambda *a: gather_attend(*a[:3], a[5], q_pos), sets, batch,
                expected, info)
    paged = cudnn_paged(jnp.asarray([length], jnp.int32), batch.kv_lens, batch.block_tables, causal=True)
    rec.measure("prefill", "cudnn-paged", params, lambda *a: paged(a[0][None], a[1], a[2])[0], sets, batch,
                expected, info)


def bench_mixed(rec: Recorder, decodes, context, chunk, chunk_context, tunings=(None,)):
    """`decodes` decodes at `context` plus one `chunk`-token prefill chunk whose kv length is chunk_context, over
    each KV_RUNS cache in each tuning."""
    q_lens, kv_lens = [1] * decodes + [chunk], [context] * decodes + [chunk_context]
    for kv_dtype, batch, expected in kv_variants(make_batch(jax.random.key(11), q_lens, kv_lens)):
        params = {"batch": decodes + 1, "context": context, "decodes": decodes, "chunk": chunk,
                  "chunk_context": chunk_context, "kv_dtype": kv_dtype}
        sets, info = rotation(batch, batch.kv_bytes, lambda i: fresh_cache_copy(batch, i))
        for tuning in tunings:
            rec.measure("mixed", "jaxserve-pallas", {**params, "tuning": tuning or TUNING or "default"},
                        ours(tuning), sets, batch, expected, info)
        if kv_dtype == "bf16":
            bench_mixed_peers(rec, params, batch, expected, sets, info)


def bench_mixed_peers(rec: Recorder, params, batch: Batch, expected, sets, info):
    decodes, context, chunk, chunk_context = (params[k] for k in ("decodes", "context", "chunk", "chunk_context"))
    dec_tables = batch.block_tables[:decodes]
    chunk_table = batch.block_tables[decodes:, :-(-chunk_context // BLOCK)]
    bench_cudnn_mixed(rec, params, batch, expected, dec_tables, chunk_table, chunk)
    dec_pos = jnp.full((decodes, 1), context - 1)
    chunk_pos = (chunk_context - chunk + jnp.arange(chunk))[None]

    def gathered(q, k, v, *_):
        return jnp.concatenate([gather_attend(q[:decodes], k, v, dec_tables, dec_pos),
                                gather_attend(q[decodes:], k, v, chunk_table[:, :-(-chunk_context // BLOCK)],
                                              chunk_pos)])
    rec.measure("mixed", "xla-gather", params, gathered, sets, batch, expected, info)


def bench_cudnn_mixed(rec: Recorder, params, batch: Batch, expected, dec_tables, chunk_table, chunk):
    """cuDNN's paged op takes one cache per call with exactly batch x width blocks: give the decodes and the
    chunk each their own cache (same bytes, gathered outside the timing) and make two calls."""
    decodes = dec_tables.shape[0]
    split = [tuple(c[t.reshape(-1)] for c in (batch.k_cache, batch.v_cache)) for t in (dec_tables, chunk_table)]
    own_tables = [jnp.arange(t.size, dtype=jnp.int32).reshape(t.shape) for t in (dec_tables, chunk_table)]
    dec = cudnn_paged(jnp.ones((decodes,), jnp.int32), batch.kv_lens[:decodes], own_tables[0], causal=False)
    pre = cudnn_paged(jnp.asarray([chunk], jnp.int32), batch.kv_lens[decodes:], own_tables[1], causal=True)
    fn = lambda q, dk, dv, ck, cv: jnp.concatenate([dec(q[:decodes, None], dk, dv)[:, 0],  # noqa: E731
                                                   pre(q[None, decodes:], ck, cv)[0]])
    sets, info = rotation(batch, 3 * L2_BYTES, lambda i: (batch.q, *split[0], *split[1]))
    rec.measure("mixed", "cudnn-paged", {**params, "calls": "decode + chunk, own caches"}, fn, sets, batch,
                expected, info)


def fits(batch_size, context, free_bytes):
    """Our cache plus one peer's copy of it (contiguous or transposed) must fit with headroom."""
    return 2 * (2 * batch_size * context * KV_HEADS * HEAD_DIM * 2) < 0.8 * free_bytes


def run_full(rec: Recorder, free_bytes):
    measure_memory(rec)
    for batch_size, context in DECODE_SWEEP:
        if fits(batch_size, context, free_bytes):
            bench_decode(rec, batch_size, context)
        else:
            rec.add("decode", "all", {"batch": batch_size, "context": context}, error="skipped: does not fit")
    bench_prefill(rec, 8192)
    bench_mixed(rec, 64, 4096, 1024, 2048)


def run_prefill(rec: Recorder):
    """Prefill backends against the peers, the Mosaic kernel's pipeline variants, and the mixed batch."""
    measure_memory(rec)
    bench_prefill(rec, 8192, tunings=(None, {"prefill_backend": "triton"}, {"prefill_backend": "mosaic"},
                                      {"mosaic_block_kv": 64}))
    bench_mosaic_variants(rec, 8192, variants=({}, {"alternate_rounds": False}))
    bench_mixed(rec, 64, 4096, 1024, 2048, tunings=(None, {"prefill_backend": "triton"}, {"prefill_backend": "mosaic"}))


def bench_mosaic_variants(rec: Recorder, length, variants=({}, {"wait_next_k_early": False})):
    """The Hopper prefill kernel alone, in each PrefillTuning variant."""
    from pallas_kernels import paged_prefill_attention_mgpu as mgpu
    batch = make_batch(jax.random.key(7), [length], [length])
    expected = reference(batch)
    sets, info = rotation(batch, 3 * L2_BYTES, lambda i: batch.args())
    for variant in variants:
        tuning = mgpu.PrefillTuning(num_ctas=jax.devices()[0].core_count, **variant)
        fn = lambda *a, t=tuning: mgpu.paged_prefill_attention(*a, sm_scale=SM_SCALE, tuning=t)  # noqa: E731
        rec.measure("prefill", "jaxserve-mosaic-only", {"batch": 1, "context": length, "variant": variant or "default"},
                    fn, sets, batch, expected, info)


def run_plans(rec: Recorder):
    """Decode paths side by side (the decode-only launch with and without its split, the mixed-batch path, the
    CUDA call's splits), cuDNN, and the launch floor (one tiny XLA kernel per call with the same arguments);
    then the prefill peers and the Mosaic kernel's work-item order."""
    measure_memory(rec)
    for batch_size, context in PLAN_POINTS:
        bf16 = make_batch(jax.random.key(batch_size * context), [1] * batch_size, [context] * batch_size)
        for kv_dtype, batch, expected in kv_variants(bf16):
            params = {"batch": batch_size, "context": context, "kv_dtype": kv_dtype}
            sets, info = rotation(batch, batch.kv_bytes, lambda i: fresh_cache_copy(batch, i))
            for path, fn in (("decode-only", ours(decode_only=True)), ("mixed-batch", ours()),
                             ("decode-only, no split", ours({**TUNING, "decode_max_splits": 1}, decode_only=True))):
                rec.measure("decode", "jaxserve-pallas", {**params, "path": path}, fn, sets, batch, expected, info)
            if kv_dtype != "bf16":
                continue
            bench_cuda_decode(rec, params, sets, batch, expected, info, split_choices=(None, 1))
            if context == 512:
                rec.measure_floor(params, sets)
            del sets
            bench_contiguous_decode(rec, params, batch, expected)
    bench_prefill(rec, 8192)
    bench_mosaic_variants(rec, 8192, variants=({}, {"alternate_rounds": False}))


MOSAIC_DECODE_VARIANTS = [{"mosaic_decode_steps": 2}, {"mosaic_decode_block_kv": 128, "mosaic_decode_steps": 2}]
MOSAIC_TUNE_POINTS = ((64, 512), (8, 4096))


def run_mosaic_decode(rec: Recorder, free_bytes, points=DECODE_SWEEP, variants=None, triton_variants=(),
                      backends=("triton", "mosaic"), cuda_splits=(None,)):
    """The decode-only launch on each of `backends` (Mosaic GPU beside Triton) over each of KV_RUNS' caches, cuDNN
    and the CUDA custom call (at each of `cuda_splits`, None its own choice), at each point; the Mosaic kernel's
    tuning `variants` at every point, or (None) its MOSAIC_DECODE_VARIANTS at the tuning points; the Triton
    launch's `triton_variants` at every point."""
    measure_memory(rec)
    for batch_size, context in sorted(points, key=lambda p: -p[0]):  # large batches first
        if not fits(batch_size, context, free_bytes):
            continue
        bf16 = make_batch(jax.random.key(batch_size * context), [1] * batch_size, [context] * batch_size)
        for kv_dtype, batch, expected in kv_variants(bf16):
            params = {"batch": batch_size, "context": context, "kv_dtype": kv_dtype, "path": "decode-only"}
            sets, info = rotation(batch, batch.kv_bytes, lambda i: fresh_cache_copy(batch, i))
            tuned = (MOSAIC_DECODE_VARIANTS if (batch_size, context) in MOSAIC_TUNE_POINTS else []) \
                if variants is None else variants
            runs = [("triton", v) for v in [{}, *triton_variants]] + [("mosaic", v) for v in [{}] + tuned]
            for backend, variant in [(b, v) for b, v in runs if b in backends]:
                rec.measure("decode", f"jaxserve-{backend}", {**params, "tuning": variant or "default"},
                            ours({**TUNING, **variant, "decode_backend": backend}, decode_only=True), sets, batch,
                            expected, info)
            if kv_dtype == "bf16":
                paged = cudnn_paged(jnp.ones((batch_size,), jnp.int32), batch.kv_lens, batch.block_tables,
                                    causal=False)
                rec.measure("decode", "cudnn-paged", params, lambda *a: paged(a[0][:, None], a[1], a[2])[:, 0],
                            sets, batch, expected, info)
            bench_cuda_decode(rec, params, sets, batch, expected, info, cuda_splits)


def run_tune(rec: Recorder):
    measure_memory(rec)
    for batch_size, context in TUNE_POINTS:
        bench_decode(rec, batch_size, context, tunings=TUNE_VARIANTS["decode"])
    bench_prefill(rec, 8192, tunings=TUNE_VARIANTS["prefill"])


def kv_dtype_of(row) -> str:
    return row["params"].get("kv_dtype", "bf16")  # rows from before fp8 caches were bf16


def pick_tuning(rows, kv_dtype="bf16") -> dict:
    """From --tune rows over `kv_dtype` caches: per bench, the variant with the best geometric-mean time relative
    to the default."""
    picked = {}
    for bench in ("decode", "prefill"):
        ok = [r for r in rows if r["bench"] == bench and "error" not in r and "ms" in r and kv_dtype_of(r) == kv_dtype]
        default = {(r["params"]["batch"], r["params"]["context"]): r["ms"] for r in ok
                   if r["params"]["tuning"] == "default"}
        scores = {}
        for r in ok:
            point = (r["params"]["batch"], r["params"]["context"])
            if point not in default:
                continue
            scores.setdefault(json.dumps(r["params"]["tuning"]), []).append(math.log(r["ms"] / default[point]))
        complete = {k: sum(v) for k, v in scores.items() if len(v) == len(default)}
        best = min(complete, key=complete.get)
        picked.update({} if best == '"default"' else json.loads(best))
    return picked


def run_profile(points=PROFILE_POINTS):
    """Run our kernel a few times at `points` (q_len, batch, context), untimed: the workload for
    `ncu -k regex:attention`. Decode points run the decode-only launch, as the engine's decode steps do."""
    for q_len, batch_size, context in points:
        fn = jax.jit(ours(decode_only=q_len == 1))
        bf16 = make_batch(jax.random.key(0), [q_len] * batch_size, [context] * batch_size)
        for batch in (with_kv_dtype(bf16, kv_dtype) for kv_dtype in KV_RUNS):
            for _ in range(3):
                jax.block_until_ready(fn(*batch.args()))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    decode = [r for r in rows if r["bench"] == "decode" and "gbps" in r and "error" not in r]
    points = sorted({(r["params"]["batch"], r["params"]["context"]) for r in decode})
    series = lambda r: r["impl"] + ("" if kv_dtype_of(r) == "bf16" else f" ({kv_dtype_of(r)} KV)")  # noqa: E731
    impls = sorted({series(r) for r in decode})
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        best = {p: max((r["gbps"] for r in decode if series(r) == impl
                        and (r["params"]["batch"], r["params"]["context"]) == p), default=0) for p in points}
        ax.bar(np.arange(len(points)) + j * width, [best[p] for p in points], width, label=impl)
    ceiling = [r["gbps"] for r in rows if r["bench"] == "memory"]
    if ceiling:
        ax.axhline(ceiling[0], color="k", ls="--", lw=1, label="memory ceiling")
    ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2, [f"B={b}\nctx={c}" for b, c in points])
    ax.set_ylabel("KV read GB/s")
    ax.set_title(f"Paged decode, Llama-3-8B heads, bf16 q, block 16 ({rows[0]['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows):
    print(f"\n{'bench':8} {'impl':17} {'kv':4} {'B':>4} {'ctx':>6} {'ms':>9} {'GB/s':>7} {'TF/s':>6} {'%mem':>6} "
          "tuning / error")
    for r in rows:
        p = r["params"]
        print(f"{r['bench']:8} {r['impl']:17} {p.get('kv_dtype', ''):4} {p.get('batch', ''):>4} "
              f"{p.get('context', ''):>6} "
              f"{r.get('ms') or float('nan'):9.4f} {r.get('gbps') or 0:7.0f} {r.get('tflops') or 0:6.1f} "
              f"{r.get('pct_memory') or 0:6.1f} {r.get('error', '')[:70] or p.get('tuning', '')}")


def main():
    global MAX_CALLS, TARGET_RUN_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="sweep Tuning variants at key points")
    parser.add_argument("--profile", action="store_true", help="run PROFILE_POINTS untimed (under ncu)")
    parser.add_argument("--prefill", action="store_true", help="prefill backends and the mixed batch only")
    parser.add_argument("--plans", action="store_true", help="decode-only plans and the CUDA call's splits")
    parser.add_argument("--mosaic-decode", action="store_true", help="decode-only on Mosaic GPU beside Triton")
    parser.add_argument("--points", nargs="+", metavar="BxCTX", help="--mosaic-decode or --profile (as decodes) at "
                        "these points (default: the sweep's, PROFILE_POINTS)")
    parser.add_argument("--mosaic-variants", metavar="JSON", help="--mosaic-decode: a JSON list of Tuning "
                        "overrides for the Mosaic kernel, timed at every point (default: its variants at the tuning "
                        "points)")
    parser.add_argument("--triton-variants", metavar="JSON", default="[]", help="--mosaic-decode: a JSON list of "
                        "Tuning overrides for the Triton launch, timed at every point beside its default")
    parser.add_argument("--decode-backends", nargs="*", choices=("triton", "mosaic"), default=("triton", "mosaic"),
                        help="--mosaic-decode: the backends timed (none: the peers alone)")
    parser.add_argument("--cuda-splits", nargs="+", default=["default"], metavar="N", help="--mosaic-decode: the "
                        "CUDA call's splits of each sequence timed ('default': its own choice)")
    parser.add_argument("--max-calls", type=int, default=MAX_CALLS, help="most calls per timed program")
    parser.add_argument("--target-ms", type=float, default=TARGET_RUN_S * 1e3, help="GPU time per timed program")
    parser.add_argument("--pick", metavar="TUNE_JSON", help="print the best Tuning overrides found by --tune")
    parser.add_argument("--tuning", default="{}", help="JSON Tuning overrides for our rows")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16",
                        help="fp8: our rows over e4m3 caches too, beside the bf16 ones (--pick: pick from those)")
    parser.add_argument("--kv-only", action="store_true", help="--kv-dtype's rows alone, without the bf16 ones and "
                        "the peers that run with them (cuDNN, the CUDA call): Triton over the same cache remains")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention_h100.json"))
    args = parser.parse_args()
    if args.pick:
        with open(args.pick) as f:
            return print(json.dumps(pick_tuning(json.load(f), args.kv_dtype)))
    TUNING.update(json.loads(args.tuning))
    KV_RUNS[:] = [args.kv_dtype] if args.kv_only or args.kv_dtype == "bf16" else ["bf16", args.kv_dtype]
    MAX_CALLS, TARGET_RUN_S = args.max_calls, args.target_ms / 1e3
    points = [tuple(map(int, p.split("x"))) for p in args.points] if args.points else None
    if args.profile:
        return run_profile([(1, *p) for p in points] if points else PROFILE_POINTS)
    rec = Recorder(args.out)
    free = jax.devices()[0].memory_stats()["bytes_limit"] if jax.default_backend() == "gpu" else 8e9
    if args.tune:
        run_tune(rec)
    elif args.prefill:
        run_prefill(rec)
    elif args.plans:
        run_plans(rec)
    elif args.mosaic_decode:
        variants = json.loads(args.mosaic_variants) if args.mosaic_variants else None
        splits = [None if n == "default" else int(n) for n in args.cuda_splits]
        run_mosaic_decode(rec, free, points or DECODE_SWEEP, variants, json.loads(args.triton_variants),
                          args.decode_backends, splits)
    else:
        run_full(rec, free)
        plot(rec.rows, os.path.splitext(args.out)[0] + ".png")
    print_table(rec.rows)


if __name__ == "__main__":
    main()
