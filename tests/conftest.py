"""Shared fixtures: the embedded model (loaded once) and tiny random HF checkpoints with their torch oracles."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # on a GPU: vattention's page pools need room

import pytest  # noqa: E402

from jaxserve.models.loader import embedded_model_path, load_model  # noqa: E402


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
