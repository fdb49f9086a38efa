"""Host-side KV block pool: every block exists from start-up, an O(1) LRU free queue, and the prefix-cache map."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

NULL_BLOCK_ID = 0  # padding tokens write here; never handed out


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set only while the block is registered in the prefix cache
    prev: Block | None = None  # free-queue links; None while the block is in use
    next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks; head = least recently freed = next evicted."""

    def __init__(self, blocks: Iterable[Block]):
        self.head, self.tail = Block(-1), Block(-1)  # sentinels: no edge cases at the ends
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        last = self.tail.prev
        block.prev, block.next = last, self.tail
        last.next = self.tail.prev = block
        self.size += 1

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise ValueError("no free KV blocks")
        block = self.head.next
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    """Owns all blocks, their ref counts and the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, Block] = {}

    def take(self, n: int) -> list[Block]:
        """Pop n blocks for reuse (LRU first); a popped block loses its prefix-cache entry."""
        taken = []
        for _ in range(n):
            block = self.free.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the queue in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching 0 join the queue's tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.append(block)

    def register(self, block: Block, block_hash: bytes) -> None:
        # A duplicate of an already cached block stays unregistered: one block per hash.
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None, max_blocks: int | None = None) -> list[bytes]:
    """Extend `hashes` in place to cover the full blocks of `token_ids` (at most `max_blocks`); returns it.

    hash_i = sha256(hash_{i-1} || int32 tokens of block i), chain seeded with sha256(cache salt).
    sha256 (not Python's per-process `hash`) keeps hashes stable across processes and makes a
    cross-tenant collision (a KV leak between salts) infeasible; at 64 bytes per call it costs
    about a microsecond per block, paid once per block per request.
    """
    start, end = len(hashes), len(token_ids) // block_size
    if max_blocks is not None:
        end = min(end, max_blocks)
    if start >= end:
        return hashes
    data = np.asarray(token_ids[start * block_size:end * block_size], dtype=np.int32).tobytes()
    parent = hashes[-1] if hashes else hashlib.sha256((cache_salt or "").encode()).digest()
    step = 4 * block_size
    for off in range(0, len(data), step):
        parent = hashlib.sha256(parent + data[off:off + step]).digest()
        hashes.append(parent)
    return hashes
