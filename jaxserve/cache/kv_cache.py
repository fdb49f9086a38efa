"""Device-side KV cache: per-layer K/V arrays (paged) or one cross-layer pair (vattention's), in-place
writes by slot, batched block copies, sizing."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import custom_calls
from jaxserve.sharding import KV_CACHE, per_shard
from pallas_kernels.ragged_paged_attention_reference import FP8_BITS


@jax.tree_util.register_dataclass
@dataclass(slots=True)
class VAttentionCache:
    """vattention's cache: K and V each [num_blocks, num_layers, block_size, num_kv_heads, head_dim], a block
    holding every layer of its tokens, so that a 2 MiB page holds a run of tokens of all layers (32 of Llama-3-8B),
    not 1,024 tokens of one layer. `layer`: the layer that a model layer writes and reads (a traced int32 scalar:
    the layers share one trace), None for the whole cache. Attention reads it as [num_blocks * num_layers,
    block_size, ...] (`layer_blocks`): layer l of block b is block b * num_layers + l."""
    k: jax.Array
    v: jax.Array
    layer: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]


# per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]; or cross-layer
KVCache = list[tuple[jax.Array, jax.Array]] | VAttentionCache
KVLayer = tuple[jax.Array, jax.Array] | VAttentionCache   # what one model layer writes and reads


def layer_of(cache: KVCache, i: int) -> KVLayer:
    """Model layer i's part of the cache."""
    if isinstance(cache, VAttentionCache):
        return VAttentionCache(cache.k, cache.v, jnp.int32(i))
    return cache[i]


def with_layer(cache: KVCache, i: int, kv_layer: KVLayer) -> KVCache:
    """The cache after model layer i wrote kv_layer."""
    if isinstance(cache, VAttentionCache):
        return VAttentionCache(kv_layer.k, kv_layer.v)
    return [*cache[:i], kv_layer, *cache[i + 1:]]


def layer_blocks(kv_layer: KVLayer) -> tuple[jax.Array, jax.Array, int, jax.Array | int]:
    """(k, v as [blocks, block_size, num_kv_heads, head_dim], layers per block, this layer's index among them)."""
    if isinstance(kv_layer, VAttentionCache):
        k, v = (x.reshape(-1, *x.shape[2:]) for x in (kv_layer.k, kv_layer.v))
        return k, v, kv_layer.num_layers, kv_layer.layer
    return *kv_layer, 1, 0


def from_layer_blocks(kv_layer: KVLayer, k: jax.Array, v: jax.Array) -> KVLayer:
    """kv_layer with k, v (as `layer_blocks` gave them) written."""
    if isinstance(kv_layer, VAttentionCache):
        return VAttentionCache(k.reshape(kv_layer.k.shape), v.reshape(kv_layer.v.shape), kv_layer.layer)
    return k, v


def layer_slot_mapping(slot_mapping: jax.Array, block_size: int, num_layers: int, layer) -> jax.Array:
    """Flat slots (block * block_size + offset) at `layer` of a cross-layer cache seen as `layer_blocks` gives it."""
    if num_layers == 1:
        return slot_mapping
    return (slot_mapping // block_size * num_layers + layer) * block_size + slot_mapping % block_size

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# kv_cache_dtype -> the cache's dtype; "auto" (None) keeps the model's
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8}
FP8_MAX = custom_calls.FP8_MAX   # 448


def kv_cache_dtype(name: str, model_dtype, platform: str | None = None) -> jnp.dtype:
    """The cache's dtype for the kv_cache_dtype knob, as a cache on `platform` stores it: on a CPU an fp8 cache
    holds its bits (FP8_BITS: XLA:CPU converts a whole f8 array for any op on it, a write included)."""
    dtype = jnp.dtype(KV_CACHE_DTYPES[name] or model_dtype)
    return FP8_BITS if platform == "cpu" and dtype == FP8 else dtype


def is_quantized_kv(dtype) -> bool:
    return jnp.dtype(dtype) in (FP8, FP8_BITS)


def kv_dtype_name(dtype) -> str:
    """The cache dtype as stats and logs name it: an fp8 cache kept as its bits is float8_e4m3fn."""
    return FP8.name if is_quantized_kv(dtype) else jnp.dtype(dtype).name


def quantize_kv(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x [T, Hkv, D] / scale [Hkv] in the cache's FP8 dtype (or its bits): custom_calls.fp8_cache_rows."""
    scaled = custom_calls.fp8_cache_rows(x, scale)
    return jax.lax.bitcast_convert_type(scaled, FP8_BITS) if jnp.dtype(dtype) == FP8_BITS else scaled


COPY_BUCKET_MIN = 16  # copy_blocks pads N to a power of two >= this: few compiled variants
GPU_MEMORY_FRACTION = 0.9  # share of free device memory (after weights and activations) given to KV
CPU_MEMORY_FRACTION = 0.25  # CPU has no allocator stats: a modest share of available host RAM...
CPU_MAX_KV_BYTES = 1 << 30  # ...capped: CPU serving is for small models and tests (1 GiB: ~23K SmolLM2 f32 tokens)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype, sharding: jax.sharding.Sharding | None = None) -> KVCache:
    _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(jnp.zeros(shape, dtype, device=sharding), jnp.zeros(shape, dtype, device=sharding))
            for _ in range(num_layers)]


def allocate_cross_layer_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                               dtype, sharding: jax.sharding.Sharding | None = None) -> VAttentionCache:
    """A zeroed VAttentionCache (the CPU stand-in of vattention's mapped ranges)."""
    _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    shape = (num_blocks, num_layers, block_size, num_kv_heads, head_dim)
    return VAttentionCache(jnp.zeros(shape, dtype, device=sharding), jnp.zeros(shape, dtype, device=sharding))


@jax.named_scope("kv_write")
def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, cross_layer: bool = False) -> tuple[jax.Array, jax.Array]:
    """Write token t's K/V to flat slot slot_mapping[t] (= block * block_size + offset); padding uses slot 0.

    Pure: call inside the jitted step with the cache donated, and it is updated in place. On an NVIDIA GPU this
    is the CUDA custom call (faster than the XLA scatter on GPU), on a CPU the CPU library's, elsewhere their
    pure-JAX reference, the same scatter. cross_layer: the caches are a cross-layer cache seen as blocks
    (`layer_blocks`), a reshape of the donated arrays, around which XLA:CPU copies the whole cache for an in-place
    custom call: there a CPU writes by the scatter.
    """
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    if cross_layer and custom_calls.cpu.available():
        return custom_calls.reshape_and_cache_reference(k_cache, v_cache, k, v, slot_mapping)
    return custom_calls.reshape_and_cache(k_cache, v_cache, k, v, slot_mapping)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="mesh")
def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array, mesh: Mesh | None = None) -> KVCache:
    """Copy blocks src[i] -> dst[i] in every layer in one device call, the cache donated (updated in place); ids
    padded by pad_block_copies (few compiled sizes). All sources are read before any destination is written. On an
    NVIDIA GPU the CUDA custom call copies (faster than XLA's copy on GPU), on a CPU the CPU library's. Under tensor
    parallelism each device copies the blocks of its own kv heads (a cache split over `mesh`'s "tp" axis needs the
    mesh)."""
    # Padding pairs have out-of-bounds dsts, which the copy skips. A cross-layer block (vattention: one device) is
    # one copy of all its layers, the cache seen as [num_blocks, num_layers * block_size, ...] (a reshape: on a CPU
    # by XLA's copy, as write_kv says why).
    if isinstance(cache, VAttentionCache):
        nb, layers, bs = cache.k.shape[:3]
        run = custom_calls.copy_blocks_reference if custom_calls.cpu.available() else custom_calls.copy_blocks
        k, v = run(*(x.reshape(nb, layers * bs, *x.shape[3:]) for x in (cache.k, cache.v)), src, dst)
        return VAttentionCache(k.reshape(cache.k.shape), v.reshape(cache.v.shape))

    def copy(cache, src, dst):
        return [custom_calls.copy_blocks(k, v, src, dst) for k, v in cache]
    return per_shard(copy, mesh, (KV_CACHE, P(), P()), KV_CACHE)(cache, src, dst)


def pad_block_copies(src, dst, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Checked (src, dst) padded to copy_bucket(n); padding pairs have out-of-bounds dsts, which are skipped."""
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    n = len(src)
    if len(dst) != n:
        raise ValueError(f"src and dst differ in length: {n} != {len(dst)}")
    if n and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_blocks):
        raise ValueError(f"src/dst block ids must be in [0, {num_blocks})")
    if len(np.unique(dst)) != n:
        raise ValueError("dst block ids must be distinct")
    size = copy_bucket(n)
    src_padded = np.zeros(size, np.int32)
    dst_padded = np.arange(num_blocks, num_blocks + size, dtype=np.int32)
    src_padded[:n], dst_padded[:n] = src, dst
    return src_padded, dst_padded


def copy_bucket(n: int) -> int:
    """Copies per call are padded to a power of two >= COPY_BUCKET_MIN: few compiled variants."""
    return max(COPY_BUCKET_MIN, 1 << max(n - 1, 0).bit_length())


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of one block across all layers, K and V."""
    _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_memory(bytes_per_block: int, *, device: jax.Device | None = None, activation_peak_bytes: int = 0,
                          fraction: float = GPU_MEMORY_FRACTION, cpu_fraction: float = CPU_MEMORY_FRACTION,
                          cpu_max_bytes: int = CPU_MAX_KV_BYTES) -> int:
    """How many blocks fit: call after the weights are on the device and the activation peak is profiled.

    With allocator stats (GPU): (bytes_limit - bytes_in_use - activation_peak_bytes) * fraction.
    Without (CPU): min(available host RAM * cpu_fraction, cpu_max_bytes) - activation_peak_bytes.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    for name, value in (("fraction", fraction), ("cpu_fraction", cpu_fraction)):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    stats = (device or jax.local_devices()[0]).memory_stats()
    if stats and "bytes_limit" in stats:
        budget = (stats["bytes_limit"] - stats["bytes_in_use"] - activation_peak_bytes) * fraction
    else:
        budget = min(available_host_bytes() * cpu_fraction, cpu_max_bytes) - activation_peak_bytes
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"KV budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of {bytes_per_block} "
                         "bytes; need >= 2 (null block + one)")
    return num_blocks


def blocks_that_fit(bytes_per_block: int, activation_peak_bytes: int, mesh: Mesh, fraction: float) -> int:
    """Blocks that fit the memory left on each of the mesh's own devices (a data-parallel replica's are not the
    first device) after the weights and the activation peak."""
    return min(num_blocks_for_memory(bytes_per_block, activation_peak_bytes=activation_peak_bytes,
                                     fraction=fraction, device=d) for d in mesh.local_devices)


def describe_kv_capacity(num_blocks: int, block_size: int, bytes_per_block: int, dtype, devices: int = 1) -> str:
    """One line for the start-up log (bytes_per_block: on each of `devices`); the null block is not usable
    capacity."""
    usable = num_blocks - 1
    return (f"KV cache ({kv_dtype_name(dtype)}): {usable:,} blocks x {block_size} = {usable * block_size:,} tokens "
            f"({usable * bytes_per_block / 2**30:.2f} GiB{f' on each of {devices} devices' if devices > 1 else ''})")


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):  # not Linux: free pages only, a lower bound
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
