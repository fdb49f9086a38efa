"""The compilation manager: the runner's graphs as AOT-compiled executables by key, compiled before serving (traced
one by one, compiled in parallel threads: XLA compiles without the GIL), and a count of the graphs that still
had to compile after start — each one a stall of every stream, so it should stay 0."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
from tqdm import tqdm

Lower = Callable[[], jax.stages.Lowered]


class CompilationManager:
    def __init__(self, num_threads: int | None = None):
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.started = False           # set once the engine serves: compiles from then on are counted
        self.compiles_after_start = 0
        self.precompiled = False       # every graph was compiled ahead: one compiling now is worth a line

    def get(self, key: tuple, lower: Lower) -> jax.stages.Compiled:
        """The executable of key, compiled now if it has not been (counted once the engine has started)."""
        executable = self.executables.get(key)
        if executable is None:
            executable = self.executables[key] = lower().compile()
            if self.started:
                self.compiles_after_start += 1
            if self.started and self.precompiled:
                print(f"jaxserve: compiled {key} while serving (every stream waited for it)", file=sys.stderr)
        return executable

    def compile_all(self, graphs: dict[tuple, Lower]) -> None:
        """Compile every graph not compiled yet: traced one by one here, compiled on a thread pool."""
        todo = {key: lower for key, lower in graphs.items() if key not in self.executables}
        with tqdm(total=len(todo), desc="compiling graphs", unit="graph", file=sys.stderr, disable=None) as bar, \
                ThreadPoolExecutor(self.num_threads, thread_name_prefix="jaxserve-compile") as pool:
            futures = {key: pool.submit(lower().compile) for key, lower in todo.items()}
            for key, future in futures.items():
                self.executables[key] = future.result()
                bar.update(1)
