"""The KV backends behind one seam: how the device cache is laid out, sized, allocated and addressed, and the host
manager that hands out its blocks to sequences. The engine starts one as a sequence of explicit steps (layout ->
size -> allocate -> host manager, llm_engine.py); the step graphs read only its layout.

- `paged` (PagedKV): per-layer pools of blocks, a sequence's blocks anywhere (a block table per sequence), shared
  between sequences by the prefix cache (kv_cache_manager.py).
- `vattention` (vattention.py): each sequence's KV in one contiguous row of a virtual range whose physical pages
  are mapped on demand; one cross-layer K and V pair."""
from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jaxserve.cache.kv_cache import (KVCache, allocate_kv_cache, blocks_that_fit, describe_kv_capacity,
                                     kv_bytes_per_block)
from jaxserve.cache.kv_cache_manager import KVCacheManager
from jaxserve.cache.vattention import VAttentionKV
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.sharding import KV_CACHE, cache_kv_heads


class KVManager(Protocol):
    """The host side of a backend, as the scheduler and the engine drive it."""
    num_blocks: int                 # block-unit capacity, the null block included
    block_size: int
    seqs: Mapping[Hashable, object]
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def max_tokens_per_seq(self) -> int: ...
    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                      block_hashes: list[bytes] | None = None) -> int: ...
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                 cache_salt: str | None = None, block_hashes: list[bytes] | None = None,
                 num_lookahead: int = 0) -> tuple[bool, int]: ...   # lookahead: paged only (drafts)
    def can_fork(self, seq_id: Hashable, num_children: int, num_tokens: int | None = None) -> bool: ...
    def forks_fit(self, num_tokens: int, n: int) -> bool: ...
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None: ...
    def free(self, seq_id: Hashable) -> None: ...
    def take_copies(self) -> tuple[np.ndarray, np.ndarray]: ...
    def take_block_updates(self) -> list[tuple[Hashable, int, list[int]]]: ...


class KVBackend(Protocol):
    """A device cache's layout (known at construction), then its size, its arrays and its host manager."""
    cache_sharding: NamedSharding
    dtype: jnp.dtype                # the cache's (kv_cache_dtype: the model's, or float8_e4m3fn)
    blocks_per_row: int | None      # contiguous kernels: a sequence is its cache row of this many blocks
    fence: bool                     # the step's logits must follow every cache read (pages unmapped behind it)

    def cache_structs(self, num_blocks: int) -> KVCache: ...
    def size(self, activation_peak: Callable[[], int]) -> int: ...   # num_blocks; calls activation_peak if needed
    def allocate(self, num_blocks: int) -> KVCache: ...
    def host_manager(self, num_blocks: int) -> KVManager: ...
    def release_at_exit(self, holder) -> None: ...   # holder.kv_cache aliases memory the backend frees at exit


class PagedKV:
    """Per-layer K and V pools of [num_blocks, block_size, kv_heads, head_dim], split on kv heads. With a draft model
    (speculative_config method draft) its layers follow the model's in the same list: one block id addresses both
    models' KV of its tokens, so block tables, copies and the block manager's count serve both."""
    blocks_per_row, fence = None, False

    def __init__(self, cfg: EngineConfig, mc: ModelConfig, mesh: Mesh, dtype, draft: ModelConfig | None = None):
        self.cfg, self.mesh, self.dtype = cfg, mesh, dtype
        self.models = (mc,) if draft is None else (mc, draft)
        self.cache_sharding = NamedSharding(mesh, KV_CACHE)

    def cache_structs(self, num_blocks: int) -> KVCache:
        return [(struct, struct) for mc in self.models
                for struct in [jax.ShapeDtypeStruct((num_blocks, self.cfg.block_size, self._kv_heads(mc), mc.head_dim),
                                                    self.dtype, sharding=self.cache_sharding)] * mc.num_layers]

    def _kv_heads(self, mc: ModelConfig) -> int:
        return cache_kv_heads(mc.num_kv_heads, self.cfg.tensor_parallel_size)

    def size(self, activation_peak: Callable[[], int]) -> int:
        """The config's num_blocks, or as many as fit each device's memory left by weights and activations."""
        cfg = self.cfg
        bytes_per_block = sum(kv_bytes_per_block(mc.num_layers, cfg.block_size,   # on each device
                                                 self._kv_heads(mc) // cfg.tensor_parallel_size, mc.head_dim,
                                                 self.dtype) for mc in self.models)
        num_blocks = cfg.num_blocks or blocks_that_fit(bytes_per_block, activation_peak(), self.mesh,
                                                       cfg.memory_fraction)
        if jax.process_count() > 1:   # multi-host: every process holds the same pool, the one that fits them all
            num_blocks = int(multihost_utils.process_allgather(np.int32(num_blocks)).min())
        print(describe_kv_capacity(num_blocks, cfg.block_size, bytes_per_block, self.dtype,
                                   cfg.tensor_parallel_size), file=sys.stderr)
        return num_blocks

    def allocate(self, num_blocks: int) -> KVCache:
        return [layer for mc in self.models for layer in allocate_kv_cache(
            mc.num_layers, num_blocks, self.cfg.block_size, self._kv_heads(mc), mc.head_dim, self.dtype,
            self.cache_sharding)]

    def host_manager(self, num_blocks: int) -> KVCacheManager:
        return KVCacheManager(num_blocks, self.cfg.block_size, enable_prefix_caching=self.cfg.enable_prefix_caching,
                              watermark=self.cfg.watermark)

    def release_at_exit(self, holder) -> None:   # XLA owns the arrays
        pass


def make_kv_backend(cfg: EngineConfig, mc: ModelConfig, mesh: Mesh, dtype, draft: ModelConfig | None = None
                    ) -> KVBackend:
    """draft: a draft model's config, whose KV the cache holds too (paged only: the config refuses vattention)."""
    if cfg.kv_backend == "vattention":
        return VAttentionKV(cfg, mc, mesh, dtype)
    return PagedKV(cfg, mc, mesh, dtype, draft)
