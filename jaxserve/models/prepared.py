"""A GGUF model as loaded (dequantized, in the model's own layout and dtype) kept on disk beside the compiled graphs:
a warm start maps its weights back instead of parsing the file's metadata, dequantizing every tensor and building
the tokenizer again, most of a CPU start's seconds. Kept under a key of the file (path, size, mtime), the dtype, the
quantization, the loader's code and the jax and flax versions, so a changed file or loader is never served from an
old copy. The model's structure (NNX graph definition and abstract state) is pickled beside the weights, as the
executables beside them are: building it again traces every parameter's initializer (~1 s); like those, the cache
directory must be the user's own."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import asdict
from pathlib import Path

import jax
import jax.numpy as jnp
import flax
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.tensor_file import SAFETENSORS_NAMES, map_safetensors, write_safetensors
from jaxserve.sharding import param_shardings

log = logging.getLogger(__name__)
WEIGHTS, META, TOKENIZER, MODULE = "weights.safetensors", "meta.json", "tokenizer", "module.pkl"
# the modules whose code decides what a prepared copy holds: a change to any makes every copy stale
KEYED_SOURCES = ("gguf.py", "gguf_blocks.py", "loader.py", "llama.py", "fp8.py", "prepared.py", "tensor_file.py")


def prepared_dir(root: str, source: Path, dtype, quantization: str | None) -> Path:
    """<root>/models/<digest of the file's path>-<digest of the rest of the key>."""
    stat = source.stat()
    where = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    key = repr((stat.st_size, stat.st_mtime_ns, jnp.dtype(dtype).name, quantization, jax.__version__,
                flax.__version__)).encode()
    code = b"".join((Path(__file__).parent / name).read_bytes() for name in KEYED_SOURCES)
    return Path(root).expanduser() / "models" / f"{where}-{hashlib.sha256(key + code).hexdigest()[:16]}"


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


def save(directory: Path, loaded) -> None:
    """loaded (a LoadedModel) into directory: written beside it, then renamed into place, so that a start reads a
    whole copy or none; the same file's older copies (another dtype, an edited file or loader) are removed. Nothing
    is kept of a model with weights on other processes, nor when the disk refuses."""
    graphdef, state = nnx.split(loaded.model)
    values = {_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}
    if not all(v.is_fully_addressable and v.dtype in SAFETENSORS_NAMES for v in values.values()):
        return
    tmp = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_safetensors(tmp / WEIGHTS, {name: np.asarray(v) for name, v in values.items()})
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        (tmp / MODULE).write_bytes(pickle.dumps((graphdef, abstract)))
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp / TOKENIZER)
        (tmp / META).write_text(json.dumps({"config": asdict(loaded.config), "quantization": loaded.quantization,
                                            "kv_scales_loaded": loaded.kv_scales_loaded,
                                            "sampling_defaults": loaded.sampling_defaults}))
        tmp.rename(directory)
        for old in directory.parent.glob(f"{directory.name.partition('-')[0]}-*"):
            if old.name != directory.name and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if not (directory / META).exists():   # else another start got there first: its copy stands
            log.warning("jaxserve: could not keep the prepared model in %s (%s); the next start loads the file "
                        "again", directory, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(directory: Path, mesh):
    """(config, model, meta, tokenizer) from directory, each weight placed shard by shard on mesh; None when there
    is no copy, or a damaged one (then it is removed, for the file's next load to keep a new one)."""
    if not (directory / META).exists():
        return None
    found = _read(directory)
    model = None if found is None else _place(*found[1:], mesh)
    if model is None:
        shutil.rmtree(directory, ignore_errors=True)
        return None
    tokenizer = None
    if (directory / TOKENIZER).exists():
        from transformers import PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory / TOKENIZER)
    return found[1], model, found[0], tokenizer


def _read(directory: Path) -> tuple[dict, ModelConfig, tuple, dict[str, np.ndarray]] | None:
    try:
        meta = json.loads((directory / META).read_text())
        cfg = ModelConfig(**meta["config"])
        module = pickle.loads((directory / MODULE).read_bytes())
        return meta, cfg, module, map_safetensors(directory / WEIGHTS)
    except Exception:   # whatever a damaged or foreign copy raises (unpickling can raise anything): load the file
        return None


def _place(cfg: ModelConfig, module: tuple, stored: dict[str, np.ndarray], mesh):
    """The model of module's graph definition and abstract state, its weights from stored; None unless stored
    holds every variable at its shape and dtype."""
    graphdef, state = module
    flat = nnx.to_flat_state(state)
    if any(_name(p) not in stored or stored[_name(p)].shape != tuple(v.shape) or stored[_name(p)].dtype != v.dtype
           for p, v in flat):
        return None
    shardings = {path: var.get_value() for path, var in nnx.to_flat_state(param_shardings(state, mesh, cfg))}
    for path, var in flat:
        a = stored[_name(path)]
        var.set_value(jax.make_array_from_callback(a.shape, shardings[path], lambda index, a=a: a[index]))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
