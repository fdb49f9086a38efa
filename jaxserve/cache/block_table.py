"""Persistent block table, one row per device slot (stable for a sequence's life), updated cell by cell; each step
gathers its rows in batch order. Under vattention's contiguous kernels a row shrinks to one cell, its sequence's
cache row (`KVRowTable`): the kernels compute the block ids."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class BlockTable:
    """`table[slot, i]` = i-th block of the sequence in that slot; unused cells hold the null block 0."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_blocks_per_seq", max_blocks_per_seq)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)

    def write(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Set the row's blocks from index `start` on (new tail blocks, or a copy-on-write replacement)."""
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"row {row}: {end} blocks exceed max_blocks_per_seq={self.table.shape[1]}")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        self.table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0


class KVRowTable:
    """`table[slot]` = the vattention cache row of the sequence in that device slot; 0, the null row, when
    unused. BlockTable's interface: the manager's block updates carry identity ids, so any id names the row."""

    def __init__(self, max_num_seqs: int, blocks_per_row: int):
        self.table = np.zeros(max_num_seqs, np.int32)
        self.blocks_per_row = blocks_per_row

    def write(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        if len(block_ids):   # an empty update (no blocks yet) names no row
            self.table[row] = block_ids[0] // self.blocks_per_row

    def clear_row(self, row: int) -> None:
        self.table[row] = 0
