"""Tensor parallelism on a `jax.sharding.Mesh`: Megatron-style placement of each parameter by its name.

Column-parallel (output features split over "tp"): q/k/v, gate/up and the LM head; row-parallel (input features
split): o and down, so each layer needs one all-reduce after attention and one after the MLP, which XLA's SPMD
partitioner inserts. Embeddings and the LM head are split by vocabulary (replicated when tp does not divide it);
norms are replicated. The paged KV cache is split on its kv-head axis; when tp exceeds the kv heads (tp a multiple
of them), K/V projections stay replicated and the cache holds each kv head tp / num_kv_heads times, one copy per
shard (see `cache_kv_heads`, models/attention.py). Loaders place each shard straight on its device.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig

TP = "tp"
STEP_DEVICES = contextvars.ContextVar("STEP_DEVICES", default=None)   # traced_on's mesh size
HEADS = P(None, TP, None)          # q/k/v and attention outputs [T, heads, head_dim]: split on heads
KV_CACHE = P(None, None, TP, None)  # a layer's K or V cache [blocks, block_size, kv_heads, head_dim]
VATTENTION_CACHE = P(None, None, None, TP, None)   # kv_cache.VAttentionCache's [blocks, layers, block_size, ...]
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJ = ("k_proj", "v_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    """A 1-D "tp" mesh over the first tensor_parallel_size devices (or the given ones)."""
    devices = list(jax.devices() if devices is None else devices)
    if not 0 < tensor_parallel_size <= len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} available ({devices[0].platform})")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def replica_meshes(data_parallel_size: int, tensor_parallel_size: int = 1, devices=None) -> list[Mesh]:
    """One "tp" mesh per data-parallel replica, over disjoint devices: replica i gets devices [i * tp, (i + 1) * tp)
    of jax.devices() (or the given ones)."""
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if (needed := data_parallel_size * tensor_parallel_size) > len(devices):
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} "
                         f"needs {needed} devices; {len(devices)} available ({devices[0].platform}): lower either")
    tp = tensor_parallel_size
    return [make_mesh(tp, devices[i * tp:(i + 1) * tp]) for i in range(data_parallel_size)]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """The shapes Megatron-style splitting needs: whole q heads and MLP columns per shard, kv heads that either
    split evenly or each serve whole shards, and whole experts per shard (a mixture of experts' experts split over
    the devices: expert parallelism)."""
    for name in ("num_heads", "intermediate_size", "num_experts"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={getattr(cfg, name)}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's num_kv_heads={cfg.num_kv_heads} "
                         "or be a multiple of it")


def cache_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads of the paged cache: the model's, or tp when tp exceeds them, each kv head then repeated for the
    tp / num_kv_heads shards whose q heads use it. So every device stores and reads only its own kv head; a
    replicated cache would cost each device every head's memory and a per-layer slice of the whole cache."""
    return max(num_kv_heads, tp)


def param_spec(path: tuple, ndim: int, shard_kv: bool, shard_vocab: bool) -> P:
    """The PartitionSpec of the parameter at an NNX state path (e.g. ("layers", 3, "self_attn", "q_proj",
    "kernel")); kernels are [in, out], Fp8Linear weights [out, in] (the kernel's spec reversed), embeddings
    [vocab, hidden]."""
    module, leaf = (path[-2] if len(path) > 1 else None), path[-1]
    if module in KV_PROJ and not shard_kv or module in VOCAB_PARALLEL and not shard_vocab:
        return P()
    if module in COLUMN_PARALLEL:   # the bias and an FP8 weight's scales follow the output features
        return {"kernel": P(None, TP), "weight": P(TP, None)}.get(leaf, P(TP))
    if module in ROW_PARALLEL:
        return {"kernel": P(TP, None), "weight": P(None, TP)}.get(leaf, P())
    if module == "embed_tokens":
        return P(TP, None)
    if module == "experts":   # expert parallelism: whole experts per device, [E, out, in] split on E
        return P(TP, None, None)
    return P(*([None] * ndim))


def param_shardings(state: nnx.State, mesh: Mesh, cfg: ModelConfig) -> nnx.State:
    """`state` (abstract or concrete) with each parameter's value replaced by its NamedSharding: the same tree
    structure, so `jax.tree.map` pairs the two. A model tp cannot split is a ValueError naming both."""
    tp = mesh.shape[TP]
    check_tensor_parallel(cfg, tp)
    shard_kv, shard_vocab = cfg.num_kv_heads % tp == 0, cfg.vocab_size % tp == 0
    flat = [(path, var.replace(NamedSharding(mesh, param_spec(path, len(var.shape), shard_kv, shard_vocab))))
            for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def concatenate_on_devices(arrays, axis: int) -> jax.Array:
    """The arrays concatenated on axis, placed as the first is (jnp's concatenate compiles once per shapes, not per
    call as a jit of a new function would)."""
    return jax.device_put(jnp.concatenate(arrays, axis), arrays[0].sharding)


def per_shard(fn, mesh: Mesh | None, in_specs, out_specs):
    """fn run on each device's shards under `jax.shard_map`: what XLA cannot split itself (custom calls, Pallas
    kernels) sees its local arrays. Without a mesh or on one device, fn itself: tp=1 compiles to what it did
    before meshes. check_vma is off because those custom calls and kernels have no varying-axes rules."""
    if mesh is None or mesh.shape[TP] == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@contextlib.contextmanager
def traced_on(mesh: Mesh | None):
    """Model code traced inside runs on mesh's devices (on_one_device); None: where the enclosing trace runs."""
    token = None if mesh is None else STEP_DEVICES.set(mesh.size)
    try:
        yield
    finally:
        if token is not None:
            STEP_DEVICES.reset(token)


def on_one_device() -> bool:
    """Whether the step being traced runs on one device, where the single-device kernels may take its layers: its
    mesh's size under traced_on (a data-parallel replica of a multi-GPU host has one), else jax.device_count()."""
    size = STEP_DEVICES.get()
    return (jax.device_count() if size is None else size) == 1
