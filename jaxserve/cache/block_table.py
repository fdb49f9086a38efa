"""Persistent block table, one row per device slot (stable for a sequence's life), updated cell by cell; each step
gathers its rows in batch order."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class BlockTable:
    """`table[row, i]` = i-th block of the seq in batch `row`; unused cells hold the null block 0."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, max_num_tokens: int):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_blocks_per_seq", max_blocks_per_seq),
                            ("block_size", block_size), ("max_num_tokens", max_num_tokens)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.block_size = block_size
        self.table = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.slot_mapping = np.zeros(max_num_tokens, np.int32)
        self._flat_index = np.zeros(max_num_tokens, np.int64)  # scratch, reused every step

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

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray,
                             num_padded: int | None = None) -> np.ndarray:
        """slot = table[row, pos // bs] * bs + pos % bs per token, vectorised into the reused buffer.

        Tokens n..num_padded-1 (bucket padding) get slot 0: their KV lands in the null block. Returns a view.
        """
        n, bs = len(rows), self.block_size
        num_padded = n if num_padded is None else num_padded
        if not n <= num_padded <= len(self.slot_mapping):
            raise ValueError(f"need len(rows)={n} <= num_padded={num_padded} "
                             f"<= max_num_tokens={len(self.slot_mapping)}")
        flat, out = self._flat_index[:n], self.slot_mapping[:n]
        np.multiply(rows, self.table.shape[1], out=flat)
        flat += positions // bs
        np.take(self.table.reshape(-1), flat, out=out)
        out *= bs
        out += positions % bs
        self.slot_mapping[n:num_padded] = 0
        return self.slot_mapping[:num_padded]
