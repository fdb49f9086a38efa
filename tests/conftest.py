"""Shared fixtures: the embedded model (loaded once) and its HF transformers oracle; tests that use them must be
marked slow. The other shared builders are in helpers.py."""
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # on a GPU: vattention's page pools need room
# CPU computations run on the calling thread: the Mosaic GPU interpreter runs each simulated CTA and warpgroup as a
# thread that executes its own computation and meets the others at barriers; dispatched to XLA:CPU's few worker
# threads (two on a two-core machine) they could all be taken by threads waiting at a barrier, a deadlock
os.environ.setdefault("JAX_CPU_ENABLE_ASYNC_DISPATCH", "false")
# and their parallel loops run on XLA:CPU's intra-op pool, whose threads a callback waiting at a barrier holds as
# well: sized by the CPU count (NPROC where set), a two-core machine's pool of two hung the interpreted Mosaic GPU
# prefill in half of its runs; 16 threads leave room for every simulated thread of the interpreted kernels
os.environ.setdefault("NPROC", "16")
# XLA's persistent cache, which jaxserve leaves off on a CPU (compilation_cache.py says why), on for the suite and the
# processes it starts: most tests compile the same small graphs, and each compiles once per machine
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/jaxserve/xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
XLA_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
ORACLE_CACHE = Path("~/.cache/jaxserve/hf_oracle").expanduser()

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
    """The same GGUF file through HF transformers (PyTorch, f32): the oracle. transformers' GGUF reader takes ~90 s
    on two cores, so what it read is kept as a safetensors checkpoint in the suite's cache, keyed by the file and
    transformers' version (the same weights: loading them again takes seconds, in another worker or run)."""
    import fcntl
    import hashlib

    import safetensors.torch
    import torch
    import transformers
    path = embedded_model_path("smollm2-135m-instruct")
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode())
    saved = ORACLE_CACHE / key.hexdigest()[:16]
    saved.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{saved}.lock", "w") as lock:   # one worker converts, another waits for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (saved / "model.safetensors").exists():   # transformers saves no GGUF-loaded model: its parts
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.float32)
            model.config.save_pretrained(saved)
            safetensors.torch.save_model(model, f"{saved}/partial.safetensors")   # shared (tied) weights once
            os.replace(f"{saved}/partial.safetensors", saved / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(saved),
                                                          dtype=torch.float32)
    safetensors.torch.load_model(model, saved / "model.safetensors")
    return model.eval()
