"""Decode-first continuous batching under one token budget per step; the scheduler owns each sequence's
lifecycle (admit, advance, fork, preempt, finish) and says everything a step needs in one `SchedulerOutput`.

Running decodes claim their token first; prefill (chunked) gets what is left of the budget, which the config check
keeps at least `min_prefill_chunk`, so a long prompt never freezes decoding and decoding never starves prefill.
Short of KV blocks, the newest running sequence is preempted by recompute: its blocks go back to the pool (tail
first) and it waits at the queue's front; on resume its freed blocks usually still hit the prefix cache. A request's
n > 1 siblings are forked in the KV manager as its prompt's last chunk is scheduled; where forks take room
(vattention copies the prompt's KV), that chunk waits until the manager says they fit, and admissions wait behind
it. A sequence is advanced when it is scheduled: the step's tokens count as computed and a sampling row appends a
PENDING token, which the engine fills when the sample lands. A decode with drafts (speculative decoding) computes
them after its token in lookahead slots: they count as computed only once verified (the engine commits them).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from jaxserve.cache.kv_backend import KVManager
from jaxserve.config import EngineConfig
from jaxserve.engine.sequence import PENDING, Sequence, SequenceStatus


@dataclass(slots=True)
class StepRow:
    seq: Sequence
    start: int              # first position computed this step
    count: int              # tokens computed this step (0 for a fork sampled from its parent's logits)
    samples: bool           # the row reaches the end of the known tokens, so it samples the next one
    num_generated: int      # output tokens before this step's sample (seeds the row's randomness, min_tokens)
    logits_from: int = -1   # row whose last token's logits this row samples (forks); -1: its own
    draft_ids: tuple[int, ...] = ()   # speculative drafts after the row's tokens (in count, not yet the sequence's)

    @property
    def num_known(self) -> int:
        """Tokens of the sequence the row computes (its drafts are not, until verified)."""
        return self.count - len(self.draft_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step, as the runner consumes it."""
    rows: list[StepRow] = field(default_factory=list)   # decodes first, then prefill chunks, then forks
    placed: list[Sequence] = field(default_factory=list)   # need a device slot: admitted, resumed or forked
    preempted: list[int] = field(default_factory=list)     # seq ids whose slots are stale
    finished: list[int] = field(default_factory=list)      # seq ids finished or aborted since the last step
    block_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)   # (seq_id, start, block ids)
    copies: tuple[np.ndarray, np.ndarray] = ()             # (src, dst) copy-on-write block ids
    forks: list[Sequence] = field(default_factory=list)    # children forked this step (in rows and placed)

    @property
    def num_tokens(self) -> int:
        return sum(row.count for row in self.rows)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVManager):
        self.cfg, self.kv = cfg, kv
        self.waiting: list[Sequence] = []     # sorted by (priority, arrival)
        self.running: list[Sequence] = []     # in admission order: the last is the newest
        self.num_preemptions = 0
        self._preempted: list[int] = []
        self._finished: list[int] = []
        self._children: dict[int, list[Sequence]] = {}   # parent seq_id -> siblings forked in the KV manager this step
        self._fork_waits = False   # a parent's last prompt chunk waits for its forks' room this step

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: (s.priority, s.arrival_time))

    def finish(self, seq: Sequence) -> None:
        """End a sequence (stopped, length or aborted): its blocks go back, its slot is released next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.kv.seqs:
            self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        self._finished.append(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.cfg.max_num_batched_tokens
        decodes = [s for s in self.running if self._decodes(s)]
        drafts_of = {seq.seq_id: tuple(seq.draft_ids) for seq in decodes if seq.draft_ids}
        for seq in self.running:
            if seq.draft_ids:
                seq.draft_ids = []
        spare = budget - len(decodes) - self.cfg.min_prefill_chunk   # tokens drafts may take
        for seq in decodes:
            if seq.status is not SequenceStatus.RUNNING:   # preempted by an older one
                continue
            drafts = drafts_of.get(seq.seq_id, ())[:max(spare, 0)]
            if drafts and not self.kv.allocate(seq.seq_id, seq.token_ids, 1, num_lookahead=len(drafts))[0]:
                drafts = ()   # drafts are a bet: short of blocks, the decode goes on without them
            if drafts or self._grow(seq, 1, out):
                self._add_row(out, seq, 1, drafts=drafts)
                spare -= len(drafts)
        budget -= out.num_tokens
        self._fork_waits = False
        for seq in [s for s in self.running if s.is_prefill]:
            budget -= self._schedule_chunk(seq, budget, out)
        while self.waiting and budget > 0 and not self._fork_waits and self._has_room(self.waiting[0]):
            used = self._admit(self.waiting[0], budget, out)
            if not used:
                break
            budget -= used
        self._fork(out)
        for row in out.rows:
            self._advance(row)
        out.preempted, self._preempted = self._preempted, []
        out.finished, self._finished = self._finished, []
        out.block_updates, out.copies = self.kv.take_block_updates(), self.kv.take_copies()
        return out

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """A speculative row's accepted drafts, now tokens of seq with their KV written by the step, count as
        computed; the KV manager covers them (in the lookahead slots the step took) and hashes their full blocks.
        Rejected drafts' places stay the sequence's, overwritten by the tokens that come next."""
        seq.num_computed_tokens += num_accepted
        self.kv.allocate(seq.seq_id, seq.token_ids, num_accepted)

    def _decodes(self, seq: Sequence) -> bool:
        return (seq.status is SequenceStatus.RUNNING and not seq.is_prefill
                and not seq.done_once_pending_lands(self.cfg.max_model_len))

    def _has_room(self, seq: Sequence) -> bool:
        """Device slots for seq and its siblings, beside those the running sequences hold or will fork."""
        seats = len(self.running) + sum(s.num_forks_pending for s in self.running)
        return seats + 1 + seq.num_forks_pending <= self.cfg.max_num_seqs

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n <= 0 or seq.status is not SequenceStatus.RUNNING or not self._forks_fit(seq, n) \
                or not self._grow(seq, n, out):
            return 0
        self._add_row(out, seq, n)
        self._fork_kv(seq, n)
        return n

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        cached = self.kv.lookup_prefix(seq.token_ids, seq.cache_salt, seq.block_hashes)
        n = min(seq.num_tokens - cached, budget)
        if not self._forks_fit(seq, n, cached):
            return 0
        ok, cached = self.kv.allocate(seq.seq_id, seq.token_ids, n, seq.cache_salt, seq.block_hashes)
        if not ok:
            return 0
        self.waiting.pop(0)
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, cached
        self.running.append(seq)
        out.placed.append(seq)
        self._add_row(out, seq, n)
        self._fork_kv(seq, n)
        return n

    def _forks_fit(self, seq: Sequence, n: int, start: int | None = None) -> bool:
        """Whether a chunk of n tokens from `start` may run: always, unless it ends the prompt of a parent whose
        forks find no room in the KV manager yet (then it waits, and so do admissions behind it)."""
        end = (seq.num_computed_tokens if start is None else start) + n
        if not seq.num_forks_pending or end < seq.num_tokens:
            return True
        fits = self.kv.can_fork(seq.seq_id, seq.num_forks_pending, end)
        self._fork_waits |= not fits
        return fits

    def _fork_kv(self, seq: Sequence, n: int) -> None:
        """The siblings of a parent whose prompt ends with this chunk, forked in the KV manager at once: nothing
        scheduled after it in this step can take their room. Their rows (and seats) follow in _fork."""
        if seq.num_forks_pending and seq.num_computed_tokens + n >= seq.num_tokens:
            children = self._children[seq.seq_id] = [seq.fork(i) for i in range(1, seq.num_forks_pending + 1)]
            for child in children:
                self.kv.fork(seq.seq_id, child.seq_id)

    def _add_row(self, out: SchedulerOutput, seq: Sequence, n: int, logits_from: int = -1,
                 drafts: tuple[int, ...] = ()) -> None:
        start, num_tokens = seq.num_computed_tokens, len(seq.token_ids)
        out.rows.append(StepRow(seq, start, n + len(drafts), start + n >= num_tokens,
                                num_tokens - seq.num_prompt_tokens, logits_from, drafts))

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of a running seq, preempting the newest others while short."""
        while not self.kv.allocate(seq.seq_id, seq.token_ids, n)[0]:
            victim = self.running[-1]
            if any(row.seq is victim for row in out.rows):   # everything newer is in this step: wait
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.insert(0, seq)
        self._preempted.append(seq.seq_id)
        self.num_preemptions += 1

    def _fork(self, out: SchedulerOutput) -> None:
        """Siblings of a request whose prompt completes this step (forked in the KV manager by _fork_kv) run,
        sampling its logits."""
        for i, row in enumerate(list(out.rows)):
            for child in self._children.pop(row.seq.seq_id, ()):
                self.running.append(child)
                out.placed.append(child)
                out.forks.append(child)
                self._add_row(out, child, 0, logits_from=i)
                row.seq.num_forks_pending = 0   # counted as seats (_has_room) until the children run

    @staticmethod
    def _advance(row: StepRow) -> None:
        row.seq.num_computed_tokens = row.start + row.num_known
        if row.samples:
            row.seq.token_ids.append(PENDING)
