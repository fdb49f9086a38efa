"""Decode-first continuous batching under one token budget per step.

Running decodes claim their token first; prefill (chunked) gets what is left of the budget, which the config
check keeps at least `min_prefill_chunk` (seed 002's `max(n_ubatch, T - D)`), so a long prompt never freezes
decoding and decoding never starves prefill. Short of KV blocks, the newest running sequence is preempted
by recompute: its blocks go back to the pool (tail first) and it waits at the queue's front; on resume its
freed blocks usually still hit the prefix cache.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jaxserve.cache.kv_cache_manager import KVCacheManager
from jaxserve.config import EngineConfig
from jaxserve.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)    # decodes first, then prefill chunks
    num_new_tokens: list[int] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)   # (parent, child) sampled this step
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager):
        self.cfg, self.kv = cfg, kv
        self.waiting: list[Sequence] = []     # sorted by (priority, arrival)
        self.running: list[Sequence] = []     # in admission order: the last is the newest
        self.num_preemptions = 0
        self.preempted: list[Sequence] = []   # since the last take_preempted: their device slots are stale

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: (s.priority, s.arrival_time))

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.seq_id in self.kv.seqs:
                self.kv.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.cfg.max_num_batched_tokens
        decodes = [s for s in self.running if not s.is_prefill and not s.done_once_pending_lands(self.cfg.max_model_len)]
        for seq in decodes:
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, 1, batch):
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
        batch.num_decodes = len(batch.seqs)
        budget -= batch.num_decodes
        for seq in [s for s in self.running if s.is_prefill]:
            budget -= self._schedule_chunk(seq, budget, batch)
        while self.waiting and budget > 0 and self._has_room(self.waiting[0]):
            used = self._admit(self.waiting[0], budget, batch)
            if not used:
                break
            budget -= used
        return batch

    def _has_room(self, seq: Sequence) -> bool:
        return len(self.running) + 1 + seq.num_forks_pending <= self.cfg.max_num_seqs

    def _schedule_chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n <= 0 or seq.status is not SequenceStatus.RUNNING or not self._grow(seq, n, batch):
            return 0
        self._append(batch, seq, n)
        return n

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        cached = self.kv.lookup_prefix(seq.token_ids, seq.cache_salt, seq.block_hashes)
        n = min(seq.num_tokens - cached, budget)
        ok, cached = self.kv.allocate(seq.seq_id, seq.token_ids, n, seq.cache_salt, seq.block_hashes)
        if not ok:
            return 0
        self.waiting.pop(0)
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, cached
        self.running.append(seq)
        self._append(batch, seq, n)
        return n

    def _append(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for n more tokens of a running seq, preempting the newest others while short."""
        while not self.kv.allocate(seq.seq_id, seq.token_ids, n)[0]:
            victim = self.running[-1]
            if victim in batch.seqs:      # everything newer is already in this step: wait for a later step
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.insert(0, seq)
        self.preempted.append(seq)
        self.num_preemptions += 1

    def take_preempted(self) -> list[Sequence]:
        out, self.preempted = self.preempted, []
        return out
