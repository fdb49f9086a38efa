"""Speculative decoding: proposers draft the next tokens of decoding sequences on the host; the step computes each
row's last token and its drafts as one short query through the same ragged paged attention, and the sampler
verifies them (sampler.verify): a row emits the drafts that match what it would have sampled, then one more token.

Proposing needs every token of a sequence on the host, so a step with drafts runs synchronously (the engine
finishes the step in flight first). Whether a step speculates is measured, not guessed: per seq bucket, the engine
times its decode steps with and without speculation (seconds per emitted token: acceptance, the verify step's
cost and the lost overlap together) and takes the faster, trying the other now and then as the requests change.
Speculation never runs for steps of more decoding sequences than speculative_config.max_num_seqs (no graphs are
compiled for them) nor for steps that sample under structured outputs (their masks follow each token)."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from jaxserve.config import MODEL_DRAFTERS, SpeculativeConfig
from jaxserve.engine.sequence import PENDING, Sequence, SequenceStatus
from jaxserve.engine.step_graphs import bucket_for

PROBE_EVERY = 16   # decisions in a bucket between tries of the way that measured slower
COST_EMA = 0.25    # weight of a new step's seconds per token in its way's running estimate


def propose_ngram(token_ids: Seq[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the longest suffix of min_n..max_n tokens that occurred earlier in token_ids, at its latest
    occurrence, proposes the (at most num_drafts) tokens that followed it there. [] when none recurs."""
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        starts = np.flatnonzero(tokens[:length - n] == suffix[0])   # occurrences that end before the suffix
        for i in range(1, n):
            starts = starts[tokens[starts + i] == suffix[i]]
        if len(starts):
            follow = starts[-1] + n
            return tokens[follow:follow + num_drafts].tolist()
    return []


@dataclass(slots=True)
class SpeculationStats:
    num_drafts: int = 0            # rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted row emits per step: its accepted drafts and the one sampled after them (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Decides which steps speculate and drafts their sequences' next tokens."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, seq_buckets: tuple[int, ...]):
        self.cfg, self.max_model_len, self.seq_buckets = cfg, max_model_len, seq_buckets
        self.stats = SpeculationStats()
        self.seconds_per_token: dict[tuple[int, bool], float] = {}   # (seq bucket, speculating) -> estimate
        self.decisions: dict[int, int] = {}

    def wants(self, num_decoding: int, constrained: bool) -> bool:
        """The next step speculates: few enough sequences decode, no request in the engine is under structured
        outputs, and speculation measured faster in their bucket (`choose`)."""
        return (0 < num_decoding <= self.cfg.max_num_seqs and not constrained
                and self.choose(bucket_for(num_decoding, self.seq_buckets)))

    def choose(self, bucket: int) -> bool:
        """Speculate in this bucket: the way measured faster, the other every PROBE_EVERY-th time; a way not yet
        measured is tried first (speculation, then not)."""
        spec, plain = (self.seconds_per_token.get((bucket, way)) for way in (True, False))
        if spec is None or plain is None:
            return spec is None
        n = self.decisions[bucket] = self.decisions.get(bucket, 0) + 1
        return (spec <= plain) != (n % PROBE_EVERY == 0)

    def observe(self, num_decoding: int, speculating: bool, seconds: float, num_tokens: int) -> None:
        """A decode step's wall time (the engine's step call) and the tokens it emitted, for its way and bucket."""
        if not 0 < num_decoding <= self.cfg.max_num_seqs or not num_tokens:
            return
        key, new = (bucket_for(num_decoding, self.seq_buckets), speculating), seconds / num_tokens
        old = self.seconds_per_token.get(key)
        self.seconds_per_token[key] = new if old is None else old + COST_EMA * (new - old)

    def propose(self, running: list[Sequence]) -> bool:
        """Drafts (Sequence.draft_ids) for the decoding sequences whose tokens are all on the host, at most as many
        as their max_tokens and max_model_len leave room for after the token the step samples anyway. Whether
        any sequence got drafts."""
        drafted = False
        for seq in running:
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefill or seq.token_ids[-1] == PENDING:
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self.cfg.num_speculative_tokens, room)
            seq.draft_ids = self.draft(seq, k)[:k] if k > 0 else []
            drafted |= bool(seq.draft_ids)
        return drafted

    def draft(self, seq: Sequence, num_drafts: int) -> list[int]:
        """The proposer: up to num_drafts tokens that may follow seq's. A draft model's (or head's) are PENDING places here,
        filled on the device once the step's blocks are allocated (ModelRunner.draft)."""
        if self.cfg.method in MODEL_DRAFTERS:
            return [PENDING] * num_drafts
        return propose_ngram(seq.token_ids, num_drafts, self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
