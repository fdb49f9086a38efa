"""XLA's persistent compilation cache, switched on once per process: by the loader (its small graphs) and the
engine (every step graph), whichever starts first. Not on a CPU: XLA:CPU serializes wrongly an executable it read
back from this cache (the copy lacks functions and fails when run: "Function select_bitcast_fusion not found",
jaxlib 0.11.2), so the runner's own executable cache (`engine.compilation.ExecutableCache`), which serves a warm
start without tracing, could never keep a graph this cache had served; there it keeps every graph itself."""
import os

import jax


def enable_compilation_cache(path: str | None) -> None:
    """XLA's persistent cache, for every graph (restarts compile nothing); on from model load (loader.load_run), so
    that the loaders' small graphs are cached too. The first directory set wins: jax opens its cache once."""
    if path and not jax.config.jax_compilation_cache_dir and jax.default_backend() != "cpu":
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
