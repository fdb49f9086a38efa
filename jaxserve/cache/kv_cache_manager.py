"""Per-sequence KV block accounting: prefix-cache hits, growth, copy-on-write of shared blocks, reclaim."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Hashable, Sequence

import numpy as np

from jaxserve.cache.block_pool import Block, BlockPool, extend_block_hashes


@dataclass(slots=True)
class SeqBlocks:
    blocks: list[Block]
    hashes: list[bytes]  # memo of the sequence's full-block hashes (may be owned by the request)
    cache_salt: str | None
    num_computed: int = 0  # tokens covered by all allocate calls so far
    num_hashed: int = 0  # leading blocks already offered to the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.01):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.copies: dict[int, int] = {}  # dst -> src of this step's copy-on-write copies
        self.updates: dict[Hashable, int] = {}  # seq -> first block index changed since take_block_updates
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def max_tokens_per_seq(self) -> int:
        """Tokens one sequence can hold: the pool past the null block and the watermark."""
        return (self.num_blocks - 1 - self.watermark_blocks) * self.block_size

    def block_ids(self, seq_id: Hashable) -> list[int]:
        return [b.block_id for b in self._seq(seq_id).blocks]

    def can_fork(self, seq_id: Hashable, num_children: int, num_tokens: int | None = None) -> bool:
        """Always: children share the parent's blocks (copy-on-write takes blocks later, through allocate)."""
        return True

    def forks_fit(self, num_tokens: int, n: int) -> bool:
        """Always: n sequences share one prompt's blocks."""
        return True

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                      block_hashes: list[bytes] | None = None) -> int:
        """Prompt tokens (a multiple of block_size, <= len - 1) whose KV is cached; takes no refs.

        Pass the request's own `block_hashes` list to hash each block once per request (it is extended in place).
        """
        return len(self._hits(token_ids, cache_salt, [] if block_hashes is None else block_hashes)) * self.block_size

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int,
                 cache_salt: str | None = None, block_hashes: list[bytes] | None = None,
                 num_lookahead: int = 0) -> tuple[bool, int]:
        """Make room for `num_new_tokens` more tokens of `token_ids` (the whole sequence so far), and for
        `num_lookahead` after them (speculative drafts: not tokens of the sequence yet, so never hashed; a later
        call that covers them once verified finds their blocks there).

        First call for a seq: takes prefix hits, then covers hits + num_new_tokens, keeping the watermark free;
        returns (ok, num_cached_tokens); its cache_salt and block_hashes stay with the seq. Later calls cover
        num_computed + num_new_tokens and return (ok, 0).
        Short of blocks -> (False, 0) with nothing changed. Blocks that become full are offered to the prefix
        cache at once, so the step that writes them must run before any of them is reused.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self.seqs.get(seq_id)
        if seq is None:
            return self._admit(seq_id, token_ids, num_new_tokens, cache_salt, block_hashes)
        start, end, bs = seq.num_computed, seq.num_computed + num_new_tokens, self.block_size
        if end > len(token_ids):
            raise ValueError(f"num_new_tokens={num_new_tokens}: {end} tokens exceed len(token_ids)={len(token_ids)}")
        blocks = seq.blocks
        cow = num_new_tokens > 0 and start % bs != 0 and blocks[start // bs].ref_cnt > 1
        num_grow = max(0, -(-(end + num_lookahead) // bs) - len(blocks))
        if (num_grow or cow) and num_grow + cow > self.num_free_blocks:
            return False, 0
        if cow:
            self._copy_on_write(seq_id, blocks, start // bs)
        if num_grow:
            self.updates[seq_id] = min(self.updates.get(seq_id, len(blocks)), len(blocks))
            blocks += self.pool.take(num_grow)
        seq.num_computed = end
        if end // bs > seq.num_hashed:   # a block filled (the check inline: this runs for every decode, every step)
            self._register(seq, token_ids)
        return True, 0

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares all of the parent's blocks, the partial last one included."""
        if child_id in self.seqs:
            raise ValueError(f"child_id {child_id!r} already has blocks")
        parent = self._seq(parent_id)
        self.pool.touch(parent.blocks)
        self.seqs[child_id] = SeqBlocks(list(parent.blocks), list(parent.hashes), parent.cache_salt,
                                        parent.num_computed, parent.num_hashed)
        self.updates[child_id] = 0

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted seq; tail blocks first so chains evict from the end.

        Raises KeyError for an unknown seq_id: a double free is a scheduler bug and must not pass silently.
        """
        seq = self._seq(seq_id)
        del self.seqs[seq_id]
        self.updates.pop(seq_id, None)
        self.pool.release(reversed(seq.blocks))

    def take_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) int32 block ids of this step's copy-on-write copies, for one copy_blocks call; clears."""
        dst = np.fromiter(self.copies.keys(), np.int32, len(self.copies))
        src = np.fromiter(self.copies.values(), np.int32, len(self.copies))
        self.copies.clear()
        return src, dst

    def take_block_updates(self) -> list[tuple[Hashable, int, list[int]]]:
        """(seq_id, start, block_ids[start:]) per seq whose block list changed since the last call; clears.

        The runner feeds each to BlockTable.write(slot_of_seq, start, ids): only changed cells are written.
        """
        out = [(s, i, [b.block_id for b in self.seqs[s].blocks[i:]]) for s, i in self.updates.items()]
        self.updates.clear()
        return out

    def _seq(self, seq_id: Hashable) -> SeqBlocks:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown seq_id {seq_id!r}")
        return seq

    def _hits(self, token_ids: Sequence[int], cache_salt: str | None, hashes: list[bytes]) -> list[Block]:
        if not self.enable_prefix_caching:
            return []
        max_hits = (len(token_ids) - 1) // self.block_size  # the last token is always recomputed for its logits
        extend_block_hashes(hashes, token_ids, self.block_size, cache_salt, max_hits)
        hits, cached = [], self.pool.cached
        for h in hashes[:max_hits]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _admit(self, seq_id, token_ids, num_new_tokens, cache_salt, block_hashes) -> tuple[bool, int]:
        hashes = [] if block_hashes is None else block_hashes
        hits = self._hits(token_ids, cache_salt, hashes)
        num_cached = len(hits) * self.block_size
        end = num_cached + num_new_tokens
        if end > len(token_ids):
            raise ValueError(f"num_new_tokens={num_new_tokens}: {num_cached} cached + new exceed "
                             f"len(token_ids)={len(token_ids)}")
        num_grow = -(-end // self.block_size) - len(hits)
        num_revived = sum(b.ref_cnt == 0 for b in hits)  # hit blocks sitting in the free queue
        if self.num_free_blocks - num_grow - num_revived < self.watermark_blocks:
            return False, 0
        self.pool.touch(hits)
        seq = self.seqs[seq_id] = SeqBlocks(hits + self.pool.take(num_grow), hashes, cache_salt, end, len(hits))
        self.updates[seq_id] = 0
        self._register(seq, token_ids)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_cached
        return True, num_cached

    def _copy_on_write(self, seq_id: Hashable, blocks: list[Block], index: int) -> None:
        old, (new,) = blocks[index], self.pool.take(1)
        self.copies[new.block_id] = old.block_id
        self.pool.release((old,))
        blocks[index] = new
        self.updates[seq_id] = min(self.updates.get(seq_id, index), index)

    def _register(self, seq: SeqBlocks, token_ids: Sequence[int]) -> None:
        num_full = seq.num_computed // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_hashed:
            return
        extend_block_hashes(seq.hashes, token_ids, self.block_size, seq.cache_salt, num_full)
        for block, h in zip(seq.blocks[seq.num_hashed:num_full], seq.hashes[seq.num_hashed:num_full]):
            self.pool.register(block, h)
        seq.num_hashed = num_full
