"""The compilation manager: the runner's graphs as AOT-compiled executables by key, compiled before serving (traced
one by one, compiled in parallel threads: XLA compiles without the GIL), and a count of the graphs that still
had to compile after start — each one a stall of every stream, so it should stay 0.

A warm start loads the executables themselves from disk (`ExecutableCache`), so it neither traces nor lowers a
graph: XLA's persistent cache alone still needs both to find its key, which was most of a warm start's time."""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


def enable_compilation_cache(path: str | None) -> None:
    """XLA's persistent cache, for every graph (restarts compile nothing); on from model load (loader.load_run), so
    that the loaders' small graphs are cached too. The first directory set wins: jax opens its cache once."""
    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@functools.cache
def source_digest(root: Path = Path(__file__).resolve().parents[2]) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for pkg in SOURCE_PACKAGES for p in (root / pkg).rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


class ExecutableCache:
    """Serialized executables on disk, named by (fingerprint, graph key). The fingerprint must cover everything a
    graph depends on beyond its key (the runner's: jax version, process, device ids and kinds, model and engine
    config, cache size, source digest). A file that cannot be read back is ignored: the graph compiles again."""

    def __init__(self, directory: str | None, fingerprint: str, backend: str | None = None):
        # Not on CPU: there some executables read back fail to run ("Function select_bitcast_fusion not found",
        # jaxlib 0.11.2), and CPU graphs are small; XLA's persistent cache still serves a warm CPU start.
        usable = directory and (backend or jax.default_backend()) != "cpu"
        self.directory = Path(directory).expanduser() / "executables" if usable else None
        self.fingerprint = fingerprint
        if usable:   # an executable that calls an FFI target loads only once the target is registered
            custom_calls.available()

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

    def save(self, key: tuple, executable: jax.stages.Compiled) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(serialize_executable.serialize(executable)))
        tmp.replace(path)   # atomic: a concurrent start reads a whole file or none


class CompilationManager:
    def __init__(self, cache: ExecutableCache | None = None, num_threads: int | None = None):
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.cache = cache or ExecutableCache(None, "")
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.started = False           # set once the engine serves: compiles from then on are counted
        self.compiles_after_start = 0
        self.loaded_from_cache = 0     # executables a start took from disk instead of compiling
        self.precompiled = False       # every graph was compiled ahead: one compiling now is worth a line

    def get(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        """The executable of key, compiled now if it has not been (counted once the engine has started)."""
        executable = self.executables.get(key)
        if executable is None:
            executable = self.executables[key] = self._load_or_compile(key, lower)
            if self.started:
                self.compiles_after_start += 1
            if self.started and self.precompiled:
                print(f"jaxserve: compiled {key} while serving (every stream waited for it)", file=sys.stderr)
        return executable

    def compile_all(self, graphs: dict[tuple, Lower]) -> None:
        """Every graph not compiled yet: from the executable cache, else traced one by one here and compiled on a
        thread pool."""
        todo = [key for key in graphs if key not in self.executables]
        with tqdm(total=len(todo), desc="compiling graphs", unit="graph", file=sys.stderr, disable=None) as bar, \
                ThreadPoolExecutor(self.num_threads, thread_name_prefix="jaxserve-compile") as pool:
            loads = {key: pool.submit(self.cache.load, key) for key in todo}   # deserializing is C++: threads overlap
            compiles = {}
            for key, future in loads.items():
                if (executable := future.result()) is not None:
                    self.executables[key] = executable
                    self.loaded_from_cache += 1
                    bar.update(1)
                else:
                    compiles[key] = pool.submit(self._compile_and_save, key, graphs[key]())
            for key, future in compiles.items():
                self.executables[key] = future.result()
                bar.update(1)

    def peek(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        """An executable that is only looked at (memory analysis), not kept or counted; cached like the others."""
        return self._load_or_compile(key, lower)

    def _load_or_compile(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        executable = self.cache.load(key)
        self.loaded_from_cache += executable is not None
        return executable or self._compile_and_save(key, lower())

    def _compile_and_save(self, key: tuple, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        executable = lowered.compile()
        self.cache.save(key, executable)
        return executable


def fingerprint(*parts) -> str:
    """What a runner's graphs depend on beyond their keys, as one string for ExecutableCache. An executable is
    bound to its devices and, on several hosts, to its process: the caller passes the device ids, and the process
    index and count are added here, so neither data-parallel replicas nor the processes of a multi-host engine
    (sharing a cache directory) load each other's executables."""
    return repr((jax.__version__, jaxlib.__version__, jax.process_index(), jax.process_count(), *parts,
                 source_digest()))
