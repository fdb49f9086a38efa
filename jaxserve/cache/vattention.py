"""vAttention mode: each sequence's KV cache is one contiguous row of a virtual range, its physical pages mapped as
tokens arrive (mechanism: custom_calls/csrc/vmm_manager.cu). `VAttentionKV` is the mode's KV backend
(kv_backend.py): the rows' layout, the page pool's size, the ranges as the cache's arrays, the host manager.

The policy lives here, and only here (the C++ manager executes it): a sequence holds one row for its life (a row,
not the runner's device slot), admission is by page budget (pages no live sequence needs, mapped or not), growth
maps pages before the step that writes them (plus a look-ahead from unmapped pages, on the mapper thread), free
keeps the row's pages mapped (deferred reclamation) and a new sequence best-fits into the free row whose mapped
pages serve it best; pages are reclaimed from free rows (and from live rows' look-ahead) only when the pool runs
short.

`VAttentionKVCacheManager` has KVCacheManager's public interface and return values, in block units, so the
scheduler runs it unchanged; its block ids are identity ids over the cache viewed as blocks: block i of row s is
s * blocks_per_row + i (the paged kernels read them through identity tables; the contiguous kernels compute them
from the row, which the runner reads off any of a sequence's ids). Row 0 is the null row: its first page
stays mapped so that padding writes (block 0) land there, and sequences get rows 1..num_seqs.
Prefix caching and copy-on-write are off in this mode; an n > 1 fork gets its own row and a copy of the
parent's KV.
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import os
import sys
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.cache.kv_cache import (CPU_MAX_KV_BYTES, VAttentionCache, allocate_cross_layer_cache, blocks_that_fit,
                                     kv_dtype_name)
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.sharding import VATTENTION_CACHE

PAGE_SIZE = 2 << 20  # the stock driver's only VMM granularity on Hopper
# The page size on CPU, where FakePageMapper stands in for the driver: the GPU's, so that the CPU runs the GPU's
# geometry; tests lower it so that a tiny model's prompts span many pages.
CPU_PAGE_SIZE = PAGE_SIZE
NUM_RANGES = 2   # K and V: a pool page backs the same virtual page in each
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def leave_gpu_memory_to_the_page_pool() -> None:
    """The page pool is allocated outside XLA's allocator, so XLA must not claim the GPU when it starts (its
    default): call before JAX starts its GPU backend (the CLI does when the config says vattention)."""
    os.environ.setdefault(PREALLOCATE_ENV, "false")


def xla_claims_gpu_memory() -> bool:
    """Whether XLA's allocator took most of the GPU at start, leaving the page pool nothing to map."""
    return (os.environ.get(PREALLOCATE_ENV, "true").lower() not in ("false", "0")
            and os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default") != "platform")


class ForkError(RuntimeError):
    """An n > 1 fork found no row or pages for its copy of the parent's KV."""


@dataclass(frozen=True)
class VAttentionGeometry:
    """Where tokens live: num_seqs + 1 rows (row 0 null) of tokens_per_row tokens of token_bytes per range."""
    num_seqs: int        # sequence rows (max_num_seqs)
    max_model_len: int
    block_size: int
    token_bytes: int      # one token in one range: layers*Hkv*D*itemsize (cross-layer K or V, kv_cache.VAttentionCache)
    num_pages: int        # pool pages; each backs the same virtual page in every range
    page_size: int = PAGE_SIZE

    def __post_init__(self):
        for name in ("num_seqs", "max_model_len", "block_size", "token_bytes", "num_pages", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def rows(self) -> int:
        return self.num_seqs + 1

    @cached_property
    def tokens_per_row(self) -> int:
        """max_model_len rounded up so that a row is whole pages and whole blocks, and an odd number of pages
        where a quantum of it is one: rows a power of two apart put every row's same offset on the same DRAM
        channels, which the contiguous decode kernel reads slower (benchmarks/vattention.py kernels)."""
        quantum = math.lcm(self.block_size, self.page_size // math.gcd(self.token_bytes, self.page_size))
        tokens = -(-self.max_model_len // quantum) * quantum
        pages, quantum_pages = tokens * self.token_bytes // self.page_size, quantum * self.token_bytes // self.page_size
        return tokens + quantum * (pages % 2 == 0 and quantum_pages % 2 == 1)

    @property
    def row_bytes(self) -> int:
        return self.tokens_per_row * self.token_bytes

    @property
    def pages_per_row(self) -> int:
        return self.row_bytes // self.page_size

    @property
    def blocks_per_row(self) -> int:
        return self.tokens_per_row // self.block_size

    def pages_for(self, num_tokens: int) -> int:
        """Leading pages of a row that hold the blocks of its first num_tokens tokens: the kernels and block
        copies touch whole blocks, and a block (or a token) may straddle two pages."""
        whole_blocks = -(-num_tokens // self.block_size) * self.block_size
        return -(-whole_blocks * self.token_bytes // self.page_size)

    def blocks_in(self, num_pages: int) -> int:
        """Whole blocks' worth of tokens in num_pages pages: the paged manager's units, rounded down."""
        return num_pages * self.page_size // (self.block_size * self.token_bytes)


class PageMapper(Protocol):
    """Executes the manager's decisions; a row's mapped pages are always its leading pages."""

    def map(self, row: int, num_pages: int) -> None: ...        # mapped when it returns
    def map_ahead(self, row: int, num_pages: int) -> None: ...  # may finish later (look-ahead)
    def trim(self, row: int, keep_pages: int) -> None: ...      # pages past keep_pages back to the pool
    def num_mapped(self, row: int) -> int: ...


class FakePageMapper:
    """CPU stand-in: no memory, the pool as page ids and the ids mapped in each row; refuses what the driver
    and the pool would (a map past the row, an empty pool). Look-ahead pages take pool pages at once but count
    as ready (safe for a step to touch) only once a synchronous map covers them, as on the mapper thread."""

    def __init__(self, num_pages: int, num_rows: int, pages_per_row: int):
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages: list[list[int]] = [[] for _ in range(num_rows)]
        self.ready = [0] * num_rows
        self.pages_per_row = pages_per_row
        self.log: list[tuple[str, int, int]] = []

    def map(self, row: int, num_pages: int) -> None:
        self._take(row, num_pages, "map")
        self.ready[row] = max(self.ready[row], num_pages)

    def map_ahead(self, row: int, num_pages: int) -> None:
        self._take(row, num_pages, "map_ahead")

    def trim(self, row: int, keep_pages: int) -> None:
        self.log.append(("trim", row, keep_pages))
        while len(self.pages[row]) > keep_pages:
            self.free.append(self.pages[row].pop())
        self.ready[row] = min(self.ready[row], keep_pages)

    def _take(self, row: int, num_pages: int, op: str) -> None:
        if num_pages > self.pages_per_row:
            raise ValueError(f"row {row}: {num_pages} pages exceed a row of {self.pages_per_row}")
        self.log.append((op, row, num_pages))
        while len(self.pages[row]) < num_pages:
            if not self.free:
                raise MemoryError("page pool exhausted")
            self.pages[row].append(self.free.pop())

    def num_mapped(self, row: int) -> int:
        return len(self.pages[row])


class CudaPageMapper:
    """The C++ manager, one per device (tensor parallelism: every device maps the same pages of its shard).

    num_tensors: 2 for the engine's cross-layer K and V ([rows * blocks_per_row, layers, block_size, Hkv, D]); any
    number of ranges of the same geometry for tests and benchmarks. dry_run: no driver (CPU tests)."""

    def __init__(self, geometry: VAttentionGeometry, *, num_tensors: int, devices: Sequence[int] = (0,),
                 dry_run: bool = False, library: str | None = None):
        from custom_calls import vmm  # deferred: builds or loads the CUDA library on first use

        self.managers = [vmm.VmmManager(device=d, num_rows=geometry.rows, num_tensors=num_tensors,
                                        row_bytes=geometry.row_bytes, num_pages=geometry.num_pages,
                                        page_size=geometry.page_size, dry_run=dry_run, path=library)
                         for d in devices]

    def map(self, row: int, num_pages: int) -> None:
        for m in self.managers:
            m.map(row, num_pages)

    def map_ahead(self, row: int, num_pages: int) -> None:
        for m in self.managers:
            m.map_async(row, num_pages)

    def trim(self, row: int, keep_pages: int) -> None:
        for m in self.managers:
            m.trim(row, keep_pages)

    def num_mapped(self, row: int) -> int:
        counts = set()
        for m in self.managers:
            m.sync()
            counts.add(m.num_mapped(row))
        (count,) = counts
        return count

    def export(self, tensor: int, shape: tuple[int, ...], dtype) -> list:
        """Range `tensor` on every device, as zero-copy jax.Arrays."""
        return [m.export(tensor, shape, dtype) for m in self.managers]

    def close(self) -> None:
        for m in self.managers:
            m.close()


@dataclass(slots=True)
class RowSeq:
    row: int
    num_computed: int = 0  # tokens covered by all allocate calls so far


@dataclass(slots=True)
class _Copies:
    """Fork copies not yet handed out, and the rows that must keep their pages until they are."""
    pairs: list[tuple[int, int]] = field(default_factory=list)   # (src, dst) block ids
    held: set[int] = field(default_factory=set)


class VAttentionKVCacheManager:
    """KVCacheManager's interface over a virtually contiguous cache; page accounting as the module says."""

    def __init__(self, geometry: VAttentionGeometry, mapper: PageMapper, *, watermark: float = 0.01,
                 lookahead_tokens: int = 0, premap: bool = False, enable_prefix_caching: bool = False):
        if enable_prefix_caching:
            raise ValueError("prefix caching is off in vattention mode (pages are per row, not shared)")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {lookahead_tokens}")
        g = self.geometry = geometry
        self.mapper, self.block_size, self.lookahead_tokens = mapper, g.block_size, lookahead_tokens
        self.enable_prefix_caching = False
        self.null_pages = g.pages_for(g.block_size)   # row 0's first block: where padding tokens write
        self.usable_pages = g.num_pages - self.null_pages
        if self.usable_pages < 1:
            raise ValueError(f"num_pages={g.num_pages} leaves no page beside the null block's {self.null_pages}")
        self.watermark_pages = int(watermark * self.usable_pages)
        self.num_blocks = 1 + g.blocks_in(self.usable_pages)   # block-unit capacity + the null block, as paged
        self.watermark_blocks = self.num_blocks - 1 - g.blocks_in(self.usable_pages - self.watermark_pages)
        self.mapped = [0] * g.rows   # leading pages mapped per row, look-ahead in flight included
        self.ready = [0] * g.rows    # leading pages a synchronous map has covered
        self.pinned = [0] * g.rows   # pages a row may not lose: its live tokens, a fork's source, the null block
        self.total_mapped = self.total_pinned = 0
        self.free_rows = list(range(1, g.rows))
        self.seqs: dict[Hashable, RowSeq] = {}
        self.live: dict[int, RowSeq] = {}   # row -> its sequence
        self.updates: dict[Hashable, int] = {}   # seq -> first block index changed since take_block_updates
        self.copies, self._fork_copies = _Copies(), _Copies()   # handed out next take_copies / the one after
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self._pin(0, self.null_pages)
        self._ensure_mapped(0, self.null_pages)
        if premap:
            self._premap()

    # ---- the paged manager's interface ---------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Budget: pages no live sequence needs (unmapped, or mapped in free rows or as look-ahead)."""
        return self.geometry.num_pages - self.total_pinned

    @property
    def num_free_blocks(self) -> int:
        return self.geometry.blocks_in(self.num_free_pages)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.usable_pages

    @property
    def max_tokens_per_seq(self) -> int:
        """Exact per-sequence capacity (the block units round down): the row, or the whole blocks of the pool
        past the watermark."""
        g = self.geometry
        pool_tokens = (self.usable_pages - self.watermark_pages) * g.page_size // g.token_bytes
        return min(g.max_model_len, pool_tokens // g.block_size * g.block_size)

    def row_of(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).row

    def block_ids(self, seq_id: Hashable) -> list[int]:
        seq = self._seq(seq_id)
        return self._identity(seq.row, 0, self._num_blocks(seq.num_computed))

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                      block_hashes: list[bytes] | None = None) -> int:
        """Prefix caching is off in vattention mode: never a hit."""
        return 0

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                 cache_salt: str | None = None, block_hashes: list[bytes] | None = None) -> tuple[bool, int]:
        """As KVCacheManager.allocate (no prefix hits: the second value is always 0). Short of pages (or, on
        admission, of a row or of the watermark) -> (False, 0) with nothing changed."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self.seqs.get(seq_id)
        start = 0 if seq is None else seq.num_computed
        end = start + num_new_tokens
        if end > len(token_ids):
            raise ValueError(f"num_new_tokens={num_new_tokens}: {end} tokens exceed len(token_ids)={len(token_ids)}")
        if end > self.geometry.max_model_len:
            raise ValueError(f"{end} tokens exceed max_model_len={self.geometry.max_model_len}")
        if seq is None:
            return self._admit(seq_id, end, len(token_ids)), 0
        if self.geometry.pages_for(end) - self.pinned[seq.row] > self.num_free_pages:
            return False, 0
        self._grow(seq_id, seq, end, len(token_ids))
        return True, 0

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child gets its own row and, at the step after next, a copy of the parent's blocks (the parent's
        last chunk is written by the step launched with this fork, so the copy must come after it).
        Raises ForkError when no row or pages are left for the copy: unlike the paged manager's shared blocks,
        the copy needs its pages now, so the scheduler must leave room for n > 1 children (see can_fork)."""
        if child_id in self.seqs:
            raise ValueError(f"child_id {child_id!r} already has blocks")
        parent = self._seq(parent_id)
        need = self.geometry.pages_for(parent.num_computed)
        if not self.free_rows or need > self.num_free_pages:
            raise ForkError(f"vattention fork of {parent_id!r}: {need} pages and a row needed, "
                            f"{self.num_free_pages} pages and {len(self.free_rows)} rows free")
        child = self._place(child_id, need)
        self._grow(child_id, child, parent.num_computed, parent.num_computed)
        n = self._num_blocks(parent.num_computed)
        self._fork_copies.pairs += zip(self._identity(parent.row, 0, n), self._identity(child.row, 0, n))
        self._fork_copies.held.add(parent.row)

    def can_fork(self, seq_id: Hashable, num_children: int, num_tokens: int | None = None) -> bool:
        """Rows and pages for num_children copies of the seq's first num_tokens tokens (default: those so far),
        beside what the seq itself needs to reach them (a seq not yet admitted: its row and pages too)."""
        seq = self.seqs.get(seq_id)
        need = self.geometry.pages_for(self._seq(seq_id).num_computed if num_tokens is None else num_tokens)
        own = need if seq is None else max(0, need - self.pinned[seq.row])
        return len(self.free_rows) >= num_children + (seq is None) and \
            own + need * num_children <= self.num_free_pages

    def forks_fit(self, num_tokens: int, n: int) -> bool:
        """Whether n copies of num_tokens tokens fit the pool at all (a parent and its n - 1 forks)."""
        return n * self.geometry.pages_for(num_tokens) <= self.usable_pages

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted seq: its row keeps its pages mapped (deferred reclamation).

        Raises KeyError for an unknown seq_id: a double free is a scheduler bug and must not pass silently.
        """
        seq = self._seq(seq_id)
        del self.seqs[seq_id], self.live[seq.row]
        self.updates.pop(seq_id, None)
        for batch in (self.copies, self._fork_copies):   # a child gone before its copy: drop the copy
            batch.pairs = [p for p in batch.pairs if p[1] // self.geometry.blocks_per_row != seq.row]
        if not self._held(seq.row):   # a fork's source keeps its pages pinned until its copy is handed out
            self._pin(seq.row, 0)
        self.free_rows.append(seq.row)

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) int32 block ids of the fork copies due now, for one copy_blocks call; clears them. The
        rows they read from keep their pages pinned until then (a new owner of such a row writes after the
        copy: the runner copies before the step)."""
        due, self.copies, self._fork_copies = self.copies, self._fork_copies, _Copies()
        for row in due.held - self.copies.held:
            seq = self.live.get(row)
            self._pin(row, 0 if seq is None else self.geometry.pages_for(seq.num_computed))
        src = np.fromiter((s for s, _ in due.pairs), np.int32, len(due.pairs))
        dst = np.fromiter((d for _, d in due.pairs), np.int32, len(due.pairs))
        return src, dst

    def take_block_updates(self) -> list[tuple[Hashable, int, list[int]]]:
        """(seq_id, start, block_ids[start:]) per seq whose block list grew since the last call; clears."""
        out = [(s, i, self._identity(self.seqs[s].row, i, self._num_blocks(self.seqs[s].num_computed)))
               for s, i in self.updates.items()]
        self.updates.clear()
        return out

    # ---- rows and pages -----------------------------------------------------------------------------
    def _premap(self) -> None:
        """Eager allocation: the whole pool mapped now, spread evenly over the free rows, so that admissions
        best-fit into rows already mapped and maps leave the steps' critical path (a pool page is a map in each of
        the 2 ranges; a per-layer layout's 64 took ~2.6 ms on the H100 for Llama-3-8B); growth past a row's share
        reclaims from free rows."""
        spare, rows = self.geometry.num_pages - self.total_mapped, sorted(self.free_rows)
        for i, row in enumerate(rows):
            pages = min(self.geometry.pages_per_row, spare // (len(rows) - i))
            if pages:
                self._ensure_mapped(row, pages)
                spare -= pages

    def _admit(self, seq_id: Hashable, end: int, num_tokens: int) -> bool:
        need = self.geometry.pages_for(end)
        if not self.free_rows or self.num_free_pages - need < self.watermark_pages:
            return False
        self._grow(seq_id, self._place(seq_id, need), end, num_tokens)
        self.prefix_cache_queries += num_tokens
        return True

    def _place(self, seq_id: Hashable, need: int) -> RowSeq:
        row = self._best_fit(need)
        self.free_rows.remove(row)
        seq = self.seqs[seq_id] = self.live[row] = RowSeq(row)
        self.updates[seq_id] = 0
        return seq

    def _best_fit(self, need: int) -> int:
        """The free row with the fewest mapped pages that still covers `need`; failing that, the most mapped
        (fewest new maps). Ties: the lowest row."""
        fits = [s for s in self.free_rows if self.mapped[s] >= need]
        if fits:
            return min(fits, key=lambda s: (self.mapped[s], s))
        return max(self.free_rows, key=lambda s: (self.mapped[s], -s))

    def _grow(self, seq_id: Hashable, seq: RowSeq, end: int, known: int) -> None:
        """Cover tokens [0, end) of a placed seq: pin and map its pages (the budget was checked), then map ahead on
        the mapper thread, while steps run: the `known` tokens (a prompt's later chunks), and look-ahead."""
        g = self.geometry
        old_blocks, need = self._num_blocks(seq.num_computed), g.pages_for(end)
        if self._num_blocks(end) > old_blocks:
            self.updates[seq_id] = min(self.updates.get(seq_id, old_blocks), old_blocks)
        seq.num_computed = end
        self._pin(seq.row, max(need, self.pinned[seq.row]))
        self._ensure_mapped(seq.row, need)
        self._map_ahead(seq.row, g.pages_for(known), reclaim=True)
        if self.lookahead_tokens:
            self._map_ahead(seq.row, g.pages_for(end + self.lookahead_tokens), reclaim=False)

    def _map_ahead(self, row: int, pages: int, *, reclaim: bool) -> None:
        """Leading pages [0, pages) of row mapped on the mapper thread: from unmapped pages and, for tokens the
        sequence is known to write (reclaim), from other rows' spare ones; look-ahead never reclaims. Pins nothing:
        they stay spare until a step needs them (_ensure_mapped then finds them mapped)."""
        g = self.geometry
        unmapped = g.num_pages - self.total_mapped
        spare = (self.total_mapped - self.total_pinned) - (self.mapped[row] - self.pinned[row]) if reclaim else 0
        extra = min(min(pages, g.pages_per_row) - self.mapped[row], unmapped + spare)
        if extra <= 0:
            return
        self._reclaim(extra - unmapped, row)
        self._set_mapped(row, self.mapped[row] + extra)
        self.mapper.map_ahead(row, self.mapped[row])

    def _ensure_mapped(self, row: int, need: int) -> None:
        """Pages [0, need) of row mapped before the step runs: look-ahead pages may still be in flight."""
        if need <= self.ready[row]:
            return
        self._reclaim(need - self.mapped[row] - (self.geometry.num_pages - self.total_mapped), row)
        self._set_mapped(row, max(need, self.mapped[row]))
        self.mapper.map(row, need)
        self.ready[row] = need

    def _reclaim(self, num_pages: int, keep_row: int) -> None:
        """Unmap num_pages spare pages (mapped, not pinned): free rows' first, largest spare first (small free
        rows stay whole for best fit), live rows' mapped-ahead pages last (they are about to be written: taking
        them makes their owner map again). Enough exist whenever total pins fit the pool."""
        while num_pages > 0:
            donors = [s for s in range(self.geometry.rows) if s != keep_row and self.mapped[s] > self.pinned[s]]
            if not donors:
                raise AssertionError("vattention accounting: pins exceed the page pool")
            donor = max(donors, key=lambda s: (s not in self.live, self.mapped[s] - self.pinned[s]))
            take = min(self.mapped[donor] - self.pinned[donor], num_pages)
            self._set_mapped(donor, self.mapped[donor] - take)
            self.ready[donor] = min(self.ready[donor], self.mapped[donor])
            self.mapper.trim(donor, self.mapped[donor])
            num_pages -= take

    def _held(self, row: int) -> bool:
        return row in self.copies.held or row in self._fork_copies.held

    def _pin(self, row: int, pages: int) -> None:
        self.total_pinned += pages - self.pinned[row]
        self.pinned[row] = pages

    def _set_mapped(self, row: int, pages: int) -> None:
        self.total_mapped += pages - self.mapped[row]
        self.mapped[row] = pages

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _identity(self, row: int, start: int, end: int) -> list[int]:
        base = row * self.geometry.blocks_per_row
        return list(range(base + start, base + end))

    def _seq(self, seq_id: Hashable) -> RowSeq:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown seq_id {seq_id!r}")
        return seq


class VAttentionKV:
    """The vattention backend: rows (a sequence's row each + the null row) in two cross-layer ranges, K and V
    (kv_cache.VAttentionCache: a token's every layer together); the cache viewed as blocks is the whole virtual
    range, so its block ids are identity ids. On GPU the ranges are the C++ manager's, mapped on demand; on CPU a
    zeroed stand-in under FakePageMapper's accounting."""
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, mesh: Mesh, dtype):
        self.cfg, self.mc, self.mesh, self.dtype = cfg, mc, mesh, dtype
        self.on_device = self.fence = mesh.devices.flat[0].platform != "cpu"
        self.cache_sharding = NamedSharding(mesh, VATTENTION_CACHE)
        token_bytes = mc.num_layers * mc.num_kv_heads * mc.head_dim * jnp.dtype(dtype).itemsize   # tp is 1
        self.geometry = VAttentionGeometry(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, token_bytes, 1,
                                    PAGE_SIZE if self.on_device else CPU_PAGE_SIZE)   # num_pages: see size
        self.blocks_per_row = self.geometry.blocks_per_row if cfg.vattention_kernels == "contiguous" else None
        self.mapper: PageMapper | None = None
        self.cache: VAttentionCache | None = None

    def cache_structs(self, num_blocks: int) -> VAttentionCache:
        shape = (num_blocks, self.mc.num_layers, self.cfg.block_size, self.mc.num_kv_heads, self.mc.head_dim)
        struct = jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.cache_sharding)
        return VAttentionCache(struct, struct)

    def size(self, activation_peak: Callable[[], int]) -> int:
        """The page pool: the config's num_blocks as the pages their tokens need (+ the null block's), or as many
        pages as fit beside weights and activations. The cache's blocks: every row's."""
        g, cfg = self.geometry, self.cfg
        self.check_memory()
        num_pages = (g.pages_for(cfg.block_size) + g.pages_for((cfg.num_blocks - 1) * cfg.block_size)
                     if cfg.num_blocks else blocks_that_fit(NUM_RANGES * g.page_size, activation_peak(), self.mesh,
                                                            cfg.memory_fraction))
        self.geometry = g = dataclasses.replace(g, num_pages=num_pages)
        print(f"KV cache (vattention, {kv_dtype_name(self.dtype)}): {num_pages:,} pages of "
              f"{g.page_size / 2**20:g} MiB in each of {NUM_RANGES} "
              f"ranges = {num_pages * g.page_size // g.token_bytes:,} tokens "
              f"({num_pages * NUM_RANGES * g.page_size / 2**30:.2f} GiB); {g.rows} rows of "
              f"{g.tokens_per_row:,} tokens reserved", file=sys.stderr)
        return g.rows * g.blocks_per_row

    def check_memory(self) -> None:
        range_bytes = NUM_RANGES * self.geometry.rows * self.geometry.row_bytes
        if self.on_device and xla_claims_gpu_memory():   # the pool's pages would find no memory to map
            raise ValueError("kv_backend=vattention maps its KV pages outside XLA's allocator, which claims most of "
                             "the GPU when JAX starts: set XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts "
                             "(`jaxserve serve` and `generate` do when the config says vattention)")
        if not self.on_device and range_bytes > CPU_MAX_KV_BYTES:   # the CPU stand-in allocates it all
            raise ValueError(f"kv_backend=vattention on CPU allocates the whole virtual range, "
                             f"{range_bytes / 2**30:.1f} GiB (> {CPU_MAX_KV_BYTES / 2**30:.0f} GiB): lower "
                             "max_num_seqs or max_model_len")

    def allocate(self, num_blocks: int) -> VAttentionCache:
        """The page pool (after precompile, like the paged cache) and the ranges as the cache's arrays: on GPU the
        manager's, zero copy; they are dropped at exit before the manager (else teardown may segfault)."""
        g = self.geometry
        if not self.on_device:
            self.mapper = FakePageMapper(g.num_pages, g.rows, g.pages_per_row)
            return allocate_cross_layer_cache(self.mc.num_layers, num_blocks, self.cfg.block_size,
                                              self.mc.num_kv_heads, self.mc.head_dim, self.dtype, self.cache_sharding)
        self.mapper = CudaPageMapper(g, num_tensors=NUM_RANGES,
                                     devices=[d.local_hardware_id for d in self.mesh.local_devices])
        struct = self.cache_structs(num_blocks).k

        def export(tensor: int) -> jax.Array:
            pieces = self.mapper.export(tensor, struct.shape, struct.dtype)
            return jax.make_array_from_single_device_arrays(struct.shape, self.cache_sharding, pieces)
        return VAttentionCache(export(0), export(1))

    def release_at_exit(self, holder) -> None:
        """At exit, holder's cache arrays (aliasing the ranges) go before the manager: else teardown may segfault."""
        if self.on_device:
            atexit.register(drop_vmm_cache, weakref.ref(holder), self.mapper)

    def host_manager(self, num_blocks: int) -> VAttentionKVCacheManager:
        cfg = self.cfg
        return VAttentionKVCacheManager(self.geometry, self.mapper, watermark=cfg.watermark,
                                        lookahead_tokens=cfg.vattention_lookahead_tokens,
                                        premap=cfg.vattention_lookahead_tokens == 0)


def drop_vmm_cache(holder_ref: weakref.ref, mapper: CudaPageMapper) -> None:
    if (holder := holder_ref()) is not None:
        holder.kv_cache = None
    mapper.close()
