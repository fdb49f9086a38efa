"""What every benchmark shares: timing, the two measured ceilings (memory bandwidth, matmul rate) and the
results format `{"bench", "impl", "params", "ms", "gbps"|"tflops"|"tok_s", "device", "jax", "commit", "command"}`."""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_cache import kv_cache_dtype
from jaxserve.models import fp8, llama

# fp8's own value, read at this module's first import: a wrapper that changes it imports this module first
UNSCALED_GEMM_MAX_TILES = fp8.UNSCALED_GEMM_MAX_TILES


@dataclass(frozen=True, slots=True)
class Bytes:
    """Bytes per element the roofline counts: the linear layers' weights, the rest (embeddings, LM head, norms:
    the model dtype) and the KV cache."""
    linear: float
    other: float
    kv: int

    @classmethod
    def of(cls, loaded, engine_cfg) -> "Bytes":
        """GGUF blocks count their bytes a weight (Q4_1: 20 bytes a 32, Q8_0: 34), the LM head's as the
        embedding's (a tied one) or its own."""
        model = jnp.dtype(loaded.dtype).itemsize
        kv = jnp.dtype(kv_cache_dtype(engine_cfg.kv_cache_dtype, loaded.dtype)).itemsize
        if (blocks := loaded.gguf_blocks) is not None:
            head = blocks.embedding if loaded.model.lm_head is None else blocks.lm_head
            return cls(block_bytes(blocks.linear), model if head is None else block_bytes(head), kv)
        return cls(1 if loaded.quantization == "fp8" else model, model, kv)


def linear_path_params() -> dict:
    """The linear layers' paths where a benchmark switched them from the default, so that a row's params tell the
    runs apart: {"w8a8": "xla"} while FP8's W8A8 layers run through XLA's GEMM instead of the CUDA kernels
    (fp8.W8A8_KERNELS off), {"bf16_decode": "kernel"} while bf16 decode rows run through the CUDA kernel
    (llama.BF16_DECODE_KERNEL on), {"unscaled_gemm_max_tiles": n} while fp8.UNSCALED_GEMM_MAX_TILES is not its own."""
    unscaled = {} if fp8.UNSCALED_GEMM_MAX_TILES == UNSCALED_GEMM_MAX_TILES else \
        {"unscaled_gemm_max_tiles": fp8.UNSCALED_GEMM_MAX_TILES}
    return ({} if fp8.W8A8_KERNELS else {"w8a8": "xla"}) | ({"bf16_decode": "kernel"} if llama.BF16_DECODE_KERNEL
                                                            else {}) | unscaled


def block_bytes(block_type: str) -> float:
    from custom_calls.gguf_matmul import BLOCK, BLOCK_TYPES
    return BLOCK_TYPES[block_type][1] / BLOCK


def device_name() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        try:
            model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            model = platform.processor()
        return f"cpu: {model}"
    return d.device_kind


def commit() -> str:
    """The checkout's commit; JAXSERVE_COMMIT names it where the tree travelled without .git (device runs)."""
    if os.environ.get("JAXSERVE_COMMIT"):
        return os.environ["JAXSERVE_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], stderr=subprocess.DEVNULL).returncode
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_ms(fn, *args, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time of fn(*args) with block_until_ready, after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def device_busy_ms(fn, *args, repeats: int = 10) -> list[float] | None:
    """GPU time of each of `repeats` runs of fn(*args): the summed durations of the kernels, copies and memsets
    the device executed (CUPTI activity records through the JAX profiler), so host launch gaps do not count.
    None when the profile holds no device stream (no GPU, or no CUPTI)."""
    events = device_events(fn, *args, repeats=repeats)
    if not events or len(events) % repeats:
        return None
    per_run = len(events) // repeats   # runs are sequential: each is the next per_run records in time order
    return [sum(d for _, d, _ in events[i * per_run:(i + 1) * per_run]) / 1e6 for i in range(repeats)]


def device_events(fn, *args, repeats: int = 10) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every kernel, copy and memset the GPU ran in `repeats` runs of fn(*args)
    after one warm-up, in time order (CUPTI activity records through the JAX profiler); [] without a GPU."""
    return sorted((start, duration, name) for plane, line, start, duration, name
                  in traced_events(fn, *args, repeats=repeats)
                  if plane.startswith("/device:GPU") and line.startswith("Stream"))


def host_events(fn, *args, repeats: int = 10) -> list[tuple[str, int, str]]:
    """(thread, duration ns, name) of every host trace event (the runtime's and the GPU driver's calls) in
    `repeats` runs of fn(*args) after one warm-up; nested events each count their whole span."""
    return [(line, duration, name) for plane, line, _, duration, name in traced_events(fn, *args, repeats=repeats)
            if plane.startswith("/host")]


def traced_events(fn, *args, repeats: int) -> list:
    """(plane name, line name, start ns, duration ns, name) of each event of a JAX profiler trace of `repeats` runs
    of fn(*args) after one warm-up (the runtime's host scopes at their finest level; Python's calls not traced)."""
    import glob
    import tempfile
    from jax.profiler import ProfileData
    jax.block_until_ready(fn(*args))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level, options.host_tracer_level = 0, 3
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, profiler_options=options):
            for _ in range(repeats):
                jax.block_until_ready(fn(*args))
        space = ProfileData.from_file(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)[0])
        return [(plane.name, line.name, e.start_ns, e.duration_ns, e.name)
                for plane in space.planes for line in plane.lines for e in line.events]


def kernel_profile(fn, *args, repeats: int = 10, top: int = 10) -> list[tuple[str, float, int]]:
    """The `top` device operations of one run of fn(*args) by summed time: (name, ms per run, launches per run),
    after rows named in <>: the run's span (first start to last end, its idle time in the name) and its 3
    longest idle gaps, each named by the operation before it."""
    events = device_events(fn, *args, repeats=repeats)
    if not events:
        return []
    per_run = len(events) // repeats
    run = events[-per_run:]
    gaps = sorted(((b[0] - a[0] - a[1]) / 1e6, a[2]) for a, b in zip(run, run[1:]))[::-1]
    span = ((run[-1][0] + run[-1][1] - run[0][0]) / 1e6, sum(g for g, _ in gaps if g > 0))
    return [(f"<span, {span[1]:.3f} ms idle>", span[0], 1), *((f"<gap after {name}>", ms, 1) for ms, name in gaps[:3]),
            *((name, ms, count // repeats) for name, ms, count in costliest(events, repeats, top))]


def costliest(events: list[tuple[int, int, str]], runs: int, top: int) -> list[tuple[str, float, int]]:
    """The `top` operation names of device_events by summed time: (name, ms per run, launches in all runs)."""
    totals: dict[str, list] = {}
    for _, duration, name in events:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += duration / 1e6 / runs
        entry[1] += 1
    return [(name, ms, count) for name, (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]


def busy_ms(fn, *args) -> float:
    """fn(*args)'s median GPU busy time where the profiler sees the device, else its median wall time. A ceiling
    is timed by the device: a call's launch and sync are not the memory's or the tensor cores' (an H200 reads
    2 GiB in 0.46 ms busy, 0.69 ms by the wall clock)."""
    busy = device_busy_ms(fn, *args) if jax.default_backend() == "gpu" else None
    return float(np.median(busy)) if busy else time_ms(fn, *args)


def memory_bandwidth_gbps(nbytes: int | None = None) -> float:
    """The memory ceiling: the faster of a reduction (bytes read) and a device copy (bytes read + written) over
    nbytes. XLA's elementwise kernels are not one: `a * 2` in bf16 streams at 3.4 TB/s on an H200, where its copy
    moves 4.3 and a reduction reads 4.7 (`bandwidth_probe_s61.log`)."""
    nbytes = nbytes or (2 << 30 if jax.default_backend() == "gpu" else 256 << 20)
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    read = x.nbytes / busy_ms(jax.jit(jnp.sum), x)
    copy = 2 * x.nbytes / busy_ms(jax.jit(lambda a: jnp.array(a, copy=True)), x)
    return max(read, copy) / 1e6


def matmul_tflops(dtype=jnp.bfloat16, n: int | None = None) -> float:
    """An n x n x n matmul's rate in dtype (FP8: the second operand [N, K], as FP8 GEMMs take it)."""
    n = n or (8192 if jax.default_backend() == "gpu" else 1024)
    a, b = (jax.random.normal(jax.random.key(i), (n, n)).astype(dtype) for i in (1, 2))
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return 2 * n**3 / busy_ms(jax.jit(dot), a, b) / 1e9


def row_key(row: dict) -> tuple:
    return row["bench"], row["impl"], json.dumps(row.get("params"), sort_keys=True)


def write_rows(path: str | pathlib.Path, rows: list[dict], command: str) -> None:
    """Add rows to the results file. A rerun on this device of the same bench, impl and params at the same commit
    replaces that run's rows; rows of other commits and devices stay (a row's same-run peers are never dropped).
    XLA_FLAGS, when set, are a param: they change what XLA builds."""
    path = pathlib.Path(path)
    meta = {"device": device_name(), "jax": jax.__version__, "commit": commit(), "command": command}
    flags = {"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}
    new = [{**r, "params": {**r.get("params", {}), **flags}, **meta} for r in rows]
    keys = {row_key(r) for r in new}
    old = json.loads(path.read_text()) if path.exists() else []
    kept = [r for r in old if (r.get("device"), r.get("commit")) != (meta["device"], meta["commit"])
            or row_key(r) not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept + new, indent=1) + "\n")
    print(f"wrote {len(new)} rows to {path}")
