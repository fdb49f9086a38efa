"""Shared fixtures: the embedded model (loaded once) and its HF transformers oracle; tests that use them must be
marked slow. The other shared builders are in helpers.py."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # on a GPU: vattention's page pools need room
# CPU computations run on the calling thread: the Mosaic GPU interpreter runs each simulated CTA and warpgroup as a
# thread that executes its own computation and meets the others at barriers; dispatched to XLA:CPU's few worker
# threads (two on a two-core machine) they could all be taken by threads waiting at a barrier, a deadlock
os.environ.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
# XLA's persistent cache, which jaxserve leaves off on a CPU (compilation_cache.py says why), on for the suite and the
# processes it starts: most tests compile the same small graphs, and each compiles once per machine
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/jaxserve/xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
XLA_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxserve.models.loader import embedded_model_path, load_model  # noqa: E402

EMBEDDED_MODEL_FIXTURES = {"smollm", "smollm_hf"}


def pytest_collection_modifyitems(config, items):
    """A test that runs the embedded model must be marked slow (`pytest -m "not slow"` is the quick loop)."""
    unmarked = [item.nodeid for item in items
                if EMBEDDED_MODEL_FIXTURES & set(item.fixturenames) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("these tests use the embedded model (smollm, smollm_hf) but are not marked "
                                "@pytest.mark.slow:\n  " + "\n  ".join(unmarked))


@pytest.fixture
def without_xla_cache():
    """XLA's persistent cache off for one test, and jax's memo of earlier tests' executables emptied: each graph
    compiles as in a fresh jaxserve process on a CPU."""
    from jax._src import compilation_cache
    jax.clear_caches()
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M (f32) as jaxserve loads it."""
    return load_model(dtype="f32")


@pytest.fixture(scope="session")
def smollm_hf():
    """The same GGUF file through HF transformers (PyTorch, f32): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM
    path = embedded_model_path("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
