"""Malformed models as a user may hand them over: each is a ModelLoadError naming the file and the fault, and
through the CLI one error line with exit code 2, never a traceback nor a model of NaN weights."""
import json
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader
from safetensors.numpy import load_file, save_file

from custom_calls import cpu as cpu_calls
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.loader import CONVERTED_META, load_model, save_converted

from helpers import HEADS, KV_HEADS, TINY_HF_KWARGS, jaxserve, write_gguf

# The tensor every weight-corrupting case spoils: its HF name, GGUF name and the name the error gives.
HF_TENSOR, GGUF_TENSOR, LOADED_TENSOR = ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight",
                                        "layers.1.mlp.up_proj.kernel")
NOT_FINITE = f"tensor {LOADED_TENSOR} holds NaN or Inf values"


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY_HF_KWARGS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf.save_pretrained(path)
    return path


def copied(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "model")


def with_config_text(text_of):
    """A case: the checkpoint with config.json replaced by text_of(its dict)."""
    def make(checkpoint, tiny_hf, tmp_path):
        path = copied(checkpoint, tmp_path)
        (path / "config.json").write_text(text_of(json.loads((path / "config.json").read_text())))
        return path, path / "config.json"
    return make


def with_config(edit):
    return with_config_text(lambda cfg: json.dumps(edit(cfg)))


def with_weights(corrupt):
    """A case: the checkpoint with model.safetensors' bytes replaced by corrupt(its bytes)."""
    def make(checkpoint, tiny_hf, tmp_path):
        path = copied(checkpoint, tmp_path)
        weights = path / "model.safetensors"
        weights.write_bytes(corrupt(weights.read_bytes()))
        return path, weights
    return make


def inf_weight(checkpoint, tiny_hf, tmp_path):
    path = copied(checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[HF_TENSOR][3, 5] = np.inf
    save_file(tensors, path / "model.safetensors")
    return path, path


def nan_gguf(qtype):
    """A case: a GGUF with 64 bytes of one tensor overwritten by 0xFF: NaN as F32, and as a Q8_0 block's scale."""
    def make(checkpoint, tiny_hf, tmp_path):
        path = tmp_path / f"tiny-{qtype}.gguf"
        write_gguf(path, tiny_hf, qtype)
        start = next(t.data_offset for t in GGUFReader(path).tensors if t.name == GGUF_TENSOR)
        raw = bytearray(path.read_bytes())
        raw[start:start + 64] = b"\xff" * 64
        path.write_bytes(raw)
        return path, path
    return make


CASES = {   # name -> (make(checkpoint, tiny_hf, tmp_path) -> (path to load, file the error names), the fault named)
    "config-is-a-list": (with_config(lambda cfg: [cfg]), "must be a JSON object, got a list"),
    "config-not-json": (with_config_text(lambda cfg: json.dumps(cfg)[:-5]), "not a readable JSON file"),
    "zero-heads": (with_config(lambda cfg: {**cfg, "num_attention_heads": 0}),
                   "num_attention_heads must be a positive int, got 0"),
    "no-vocab-size": (with_config(lambda cfg: {k: v for k, v in cfg.items() if k != "vocab_size"}),
                      "missing required field vocab_size"),
    "negative-size": (with_config(lambda cfg: {**cfg, "intermediate_size": -128}),
                      "intermediate_size must be a positive int, got -128"),
    "size-is-a-string": (with_config(lambda cfg: {**cfg, "hidden_size": "64"}),
                         "hidden_size must be a positive int, got '64'"),
    "eps-is-a-string": (with_config(lambda cfg: {**cfg, "rms_norm_eps": "tiny"}),
                        "rms_norm_eps must be a positive number, got 'tiny'"),
    "random-header": (with_weights(lambda raw: bytes(range(256)) * 4), "corrupt safetensors file"),
    "header-longer-than-file": (with_weights(lambda raw: struct.pack("<Q", len(raw)) + raw[8:]),
                                "corrupt safetensors file"),
    "truncated-safetensors": (with_weights(lambda raw: raw[:len(raw) // 2]), "corrupt safetensors file"),
    "inf-in-safetensors": (inf_weight, NOT_FINITE),
    "nan-in-f32-gguf": (nan_gguf("F32"), NOT_FINITE),
    # Q8_0 stays in blocks where the CPU kernel runs: the layer's weight is its blocks, checked dequantized
    "nan-in-q8-gguf": (nan_gguf("Q8_0"), NOT_FINITE.replace(".kernel", ".weight") if cpu_calls.available()
                       else NOT_FINITE),
}
CLI_CASES = ("config-is-a-list", "zero-heads", "truncated-safetensors", "nan-in-f32-gguf")


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as error:
        load_model(str(path), dtype="f32")
    return str(error.value)


@pytest.mark.parametrize("case", CASES)
def test_malformed_model_is_a_load_error_naming_file_and_fault(checkpoint, tiny_hf, tmp_path, case):
    make, fault = CASES[case]
    path, named = make(checkpoint, tiny_hf, tmp_path)
    message = load_error(path)
    assert message.startswith(f"{named}: ") and fault in message and "\n" not in message, message


@pytest.mark.slow
@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_reports_a_malformed_model_in_one_line(checkpoint, tiny_hf, tmp_path, case):
    make, fault = CASES[case]
    path, named = make(checkpoint, tiny_hf, tmp_path)
    run = jaxserve("generate", "--model", str(path), "hi", timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("jaxserve generate: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"jaxserve generate: error: {named}: "), run.stderr
    assert fault in errors[0], run.stderr


@pytest.fixture(scope="module")
def converted_with_nan(checkpoint, tmp_path_factory):
    """An orbax directory (`jaxserve convert`) of the tiny model with one NaN weight."""
    loaded = load_model(str(checkpoint), dtype="f32")
    kernel = loaded.model.layers[1].mlp.up_proj.kernel
    kernel.set_value(kernel.get_value().at[5, 3].set(jnp.nan))
    return save_converted(loaded, tmp_path_factory.mktemp("converted") / "orbax")


def test_converted_model_with_nan_weights_is_refused(converted_with_nan):
    assert load_error(converted_with_nan).startswith(f"{converted_with_nan}: {NOT_FINITE}")


def test_converted_model_with_a_bad_config_is_refused(converted_with_nan, tmp_path):
    path = shutil.copytree(converted_with_nan, tmp_path / "orbax")
    meta = json.loads((path / CONVERTED_META).read_text())
    (path / CONVERTED_META).write_text(json.dumps({**meta, "config": {**meta["config"], "num_heads": 0}}))
    assert load_error(path) == f"{path / CONVERTED_META}: num_heads must be a positive int, got 0"


def test_converted_model_without_its_parameters_is_refused(converted_with_nan, tmp_path):
    path = shutil.copytree(converted_with_nan, tmp_path / "orbax")
    shutil.rmtree(path / "params")
    assert load_error(path).startswith(f"{path / 'params'}: unreadable orbax checkpoint")


def test_an_intact_checkpoint_still_loads(checkpoint):
    assert load_model(str(checkpoint), dtype="f32").config.num_heads == HEADS
