"""The compilation manager: the runner's graphs as AOT-compiled executables by key, compiled before serving (traced
one by one, compiled in parallel threads: XLA compiles without the GIL), and a count of the graphs that still
had to compile after start — each one a stall of every stream, so it should stay 0.

A warm start loads the executables themselves from disk (`ExecutableCache`), so it neither traces nor lowers a
graph: XLA's persistent cache alone still needs both to find its key, which was most of a warm start's time."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable
from tqdm import tqdm

import custom_calls

Lower = Callable[[], jax.stages.Lowered]
# Whatever the graphs are built from; a change to any of these files makes every cached executable stale.
SOURCE_PACKAGES = ("jaxserve", "pallas_kernels", "custom_calls")
SOURCE_SUFFIXES = (".py", ".so", ".cu", ".cc", ".h")
_compiling = threading.local()   # per compiling thread: whether XLA compiled its last graph, or a cache served it


def _note_xla_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compiling.served = True


def _note_backend_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":   # a compile or a persistent-cache hit, not jax's memo
        _compiling.reached_backend = True


jax.monitoring.register_event_listener(_note_xla_cache_hit)
jax.monitoring.register_event_duration_secs_listener(_note_backend_compile)


@functools.cache
def source_digest(root: Path = Path(__file__).resolve().parents[2]) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for pkg in SOURCE_PACKAGES for p in (root / pkg).rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def load_mosaic_runtime() -> None:
    """An executable holding Mosaic GPU kernels finds their runtime library through the path importing Mosaic GPU
    sets (MOSAIC_GPU_RUNTIME_LIB_PATH): a process that loads such executables before it builds a kernel (its Mosaic
    import is lazy) must import it first, or each one fails to load ("Symbols not found: mosaic_gpu_init_tma_desc")
    and compiles again. Hopper only, where the kernels run."""
    from pallas_kernels.ragged_paged_attention import gpu_capability
    if gpu_capability() >= 9.0:
        importlib.import_module("jax.experimental.mosaic.gpu")


class ExecutableCache:
    """Serialized executables on disk, named by (fingerprint, graph key). The fingerprint must cover everything a
    graph depends on beyond its key (the runner's: jax version, process, device ids and kinds, model and engine
    config, cache size, source digest). A file that cannot be read back is ignored: the graph compiles again."""

    def __init__(self, directory: str | None, fingerprint: str):
        self.directory = Path(directory).expanduser() / "executables" if directory else None
        self.fingerprint = fingerprint
        # XLA:CPU serializes wrongly an executable it read back from its persistent cache (the copy fails when run:
        # "Function select_bitcast_fusion not found", jaxlib 0.11.2). jaxserve leaves that cache off on a CPU, but a
        # process may turn it on itself (JAX_COMPILATION_CACHE_DIR): there only executables XLA compiled in the call
        # are kept, not one a cache handed back (jax's in-memory one may hold what the persistent one served)
        self.keeps_served = jax.default_backend() != "cpu"
        if directory:   # an executable that calls an FFI target loads only once the target is registered
            custom_calls.available()
            custom_calls.cpu.available()
            load_mosaic_runtime()

    def path(self, key: tuple) -> Path:
        return self.directory / (hashlib.sha256(f"{self.fingerprint}{key!r}".encode()).hexdigest()[:40] + ".bin")

    def load(self, key: tuple) -> jax.stages.Compiled | None:
        if self.directory is None or not (path := self.path(key)).exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:   # a truncated file, a jax that cannot read an old format: compile instead
            reason = str(e).partition("\n")[0][:300]
            print(f"jaxserve: compiling {key} again: its cached executable {path.name} did not load "
                  f"({type(e).__name__}: {reason})", file=sys.stderr)
            return None

    def note_first_wanted(self, keys: list[tuple]) -> None:
        """The graphs a lazy start wanted first, in order (a later start of the same engine prefetches them)."""
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.wanted_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text("".join(f"{self.path(key).name}\n" for key in keys))
            tmp.replace(self.wanted_file)

    def first_wanted(self, keys) -> list[tuple]:
        """Those of keys the last lazy start wanted first, in its order, that are on disk."""
        if self.directory is None or not self.wanted_file.exists():
            return []
        by_name = {self.path(key).name: key for key in keys}
        names = self.wanted_file.read_text().split()
        return [by_name[name] for name in names if name in by_name and (self.directory / name).exists()]

    @property
    def wanted_file(self) -> Path:
        return self.directory / (hashlib.sha256(self.fingerprint.encode()).hexdigest()[:40] + ".wanted")

    def save(self, key: tuple, executable: jax.stages.Compiled, compiled: bool) -> None:
        """compiled: XLA compiled it in the call that gave it, rather than a cache handing it back."""
        if self.directory is None or not (compiled or self.keeps_served):
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(serialize_executable.serialize(executable)))
        tmp.replace(path)   # atomic: a concurrent start reads a whole file or none


class CompilationManager:
    """The runner's executables by key. A start submits graphs (`submit`: loaded from the executable cache, else
    traced here and compiled on a thread pool) and waits for them (`wait`), so that graphs compile while others
    are traced or waited for; `get` compiles one on first use. `timings` says where a start's time went."""

    def __init__(self, cache: ExecutableCache | None = None, num_threads: int | None = None,
                 options: Callable[[tuple], dict] = lambda key: {}):
        self.options = options         # XLA compiler options by graph key
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.pending: dict[tuple, Future] = {}   # submitted, not yet waited for
        self.peeks: set[tuple] = set()           # pending graphs only looked at: handed back, not kept
        self.cache = cache or ExecutableCache(None, "")
        # 8: on the H100's 16 cores, 16 threads started 8B-shaped graphs 5 s later (each XLA compile has threads)
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.started = False           # set once the engine serves: compiles from then on are counted
        self.compiles_after_start = 0
        self.loaded_from_cache = 0     # executables a start took from disk instead of compiling
        self.first_wanted: list[tuple] = []   # graphs first asked of `get` (not compiled ahead), in order
        self.precompiled = False       # every graph was compiled ahead: one compiling now is worth a line
        # seconds: tracing + lowering (main thread), waiting for the pool (main thread), compiling (summed over
        # threads), the runner's phases (peak_s, precompile_s); per graph kind (key[0]) counts and seconds
        self.timings = {"trace_s": 0.0, "wait_s": 0.0, "compile_s": 0.0, "kinds": {}}
        self.compile_span = [math.inf, 0.0]   # first start and last end of a compile before the engine serves
        self.pool: ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def get(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        """The executable of key, compiled now if it has not been (counted once the engine has started). A graph
        first wanted here (not compiled ahead) is noted in the executable cache, for the next start to prefetch."""
        if key in self.executables:
            return self.executables[key]
        if key in self.pending:
            executable = self.wait([key])[key]
        else:
            executable = self.executables[key] = self._load_or_compile(key, lower)
            if self.started:
                self.compiles_after_start += 1
            if self.started and self.precompiled:
                print(f"jaxserve: compiled {key} while serving (every stream waited for it)", file=sys.stderr)
        self.first_wanted.append(key)
        self.cache.note_first_wanted(self.first_wanted)
        return executable

    def prefetch(self, graphs: dict[tuple, Lower]) -> None:
        """Load graphs from the executable cache on the pool (compiling any that does not load), for `get` to find
        loaded or under way: what a lazy start's first steps want, deserialized while the start goes on."""
        todo = [key for key in graphs if key not in self.executables and key not in self.pending]
        if todo:
            self.pool = self.pool or ThreadPoolExecutor(self.num_threads, thread_name_prefix="jaxserve-compile")
        for key in todo:
            self.pending[key] = self.pool.submit(self._load_or_compile, key, graphs[key])

    def submit(self, graphs: dict[tuple, Lower], peek: bool = False) -> None:
        """Start every graph neither had nor under way: from the executable cache, else traced here one by one (in
        order: tracing holds the GIL) and compiled on the thread pool (XLA compiles without it). peek: graphs
        only looked at (memory analysis), which `wait` hands back but nothing keeps."""
        todo = {key: lower for key, lower in graphs.items() if key not in self.executables and key not in self.pending}
        with ThreadPoolExecutor(self.num_threads) as loader:   # deserializing is C++: threads overlap
            loads = {key: loader.submit(self.cache.load, key) for key in todo}
        self.pool = self.pool or ThreadPoolExecutor(self.num_threads, thread_name_prefix="jaxserve-compile")
        for key, load in tqdm(loads.items(), desc="tracing graphs", unit="graph", file=sys.stderr, disable=None):
            loaded = load.result() is not None
            self._count(key, "loaded", loaded)
            self.pending[key] = load if loaded else self.pool.submit(self._compile, key, self._trace(key, todo[key]))
        if peek:
            self.peeks.update(todo)

    def wait(self, keys=None) -> dict[tuple, jax.stages.Compiled]:
        """The executables of keys (default: every graph under way), once loaded or compiled."""
        keys, start = list(self.pending if keys is None else keys), time.perf_counter()
        futures = [self.pending[key] for key in keys if key in self.pending]
        with tqdm(total=len(futures), desc="compiling graphs", unit="graph", file=sys.stderr, disable=None) as bar:
            for _ in as_completed(futures):
                bar.update(1)
        executables = {}
        for key in keys:
            executable = executables[key] = self.pending.pop(key).result() if key in self.pending \
                else self.executables[key]
            if key not in self.peeks:
                self.executables[key] = executable
            self.peeks.discard(key)
        if not self.pending and self.pool is not None:   # idle: its threads go (a start makes a new one)
            self.pool.shutdown()
            self.pool = None
        self.timings["wait_s"] += time.perf_counter() - start
        return executables

    def compile_all(self, graphs: dict[tuple, Lower]) -> None:
        """Every graph not had yet, and every graph under way."""
        self.submit(graphs)
        self.wait()

    @contextlib.contextmanager
    def timed(self, name: str):
        """Adds the seconds of its block to timings[name] (the runner's start-up phases)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def report(self) -> dict:
        """timings, rounded, with the compile threads and the wall time from the first compile's start to the last
        one's end (before serving)."""
        def rounded(d: dict) -> dict:
            return {k: rounded(v) if isinstance(v, dict) else round(v, 3) for k, v in d.items()}
        first, last = self.compile_span
        return {"threads": self.num_threads, "compile_wall_s": round(max(last - first, 0.0), 3),
                **rounded(self.timings)}

    def _load_or_compile(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        executable = self.cache.load(key)
        self._count(key, "loaded", executable is not None)
        return executable or self._compile(key, self._trace(key, lower))

    def _trace(self, key: tuple, lower: Lower) -> jax.stages.Lowered:
        start = time.perf_counter()
        lowered = lower()
        self._count(key, "trace_s", time.perf_counter() - start)
        return lowered

    def _compile(self, key: tuple, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        start = time.perf_counter()
        _compiling.reached_backend = _compiling.served = False
        executable = lowered.compile(self.options(key) or None)
        end = time.perf_counter()
        self.cache.save(key, executable, _compiling.reached_backend and not _compiling.served)
        self._count(key, "compile_s", end - start)
        self._count(key, "compiled", 1)
        if not self.started:
            with self.lock:
                self.compile_span[:] = min(self.compile_span[0], start), max(self.compile_span[1], end)
        return executable

    def _count(self, key: tuple, name: str, amount: float) -> None:
        """Adds amount to the timing name of key's kind (and to the total of a *_s timing), from any thread."""
        with self.lock:
            kind = self.timings["kinds"].setdefault(key[0], {"compiled": 0, "loaded": 0, "trace_s": 0.0,
                                                             "compile_s": 0.0})
            kind[name] += amount
            if name.endswith("_s"):
                self.timings[name] += amount
            if name == "loaded":
                self.loaded_from_cache += amount


def fingerprint(*parts) -> str:
    """What a runner's graphs depend on beyond their keys, as one string for ExecutableCache. An executable is
    bound to its devices and, on several hosts, to its process: the caller passes the device ids, and the process
    index and count are added here, so neither data-parallel replicas nor the processes of a multi-host engine
    (sharing a cache directory) load each other's executables. XLA_FLAGS change what XLA builds: they are in it."""
    return repr((jax.__version__, jaxlib.__version__, jax.process_index(), jax.process_count(), *parts,
                 os.environ.get("XLA_FLAGS", ""), source_digest()))
