"""A sequence: one generation stream (a request has n of them), and the vLLM-shaped outputs it becomes."""
from __future__ import annotations

import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field

from jaxserve.engine.sampling_params import SamplingParams


PENDING = -1   # a sampled token still on the device (async scheduling): always at the tail of token_ids
next_seq_id = itertools.count().__next__   # sequence ids are unique per process


def stable_seed(*parts) -> int:
    """A seed for requests that gave none: stable across processes (Python's str hash is not)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()) % 2**63


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)   # identity: the scheduler's lists hold distinct sequences
class Sequence:
    seq_id: int
    request_id: str
    index: int                     # which of the request's n outputs this is
    token_ids: list[int]           # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int                      # params.seed (+ index for forks) or drawn by the engine
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0   # tokens whose KV is in the cache (or being written this step)
    block_hashes: list[bytes] = field(default_factory=list)   # prefix-cache hashes, computed once
    cache_salt: str | None = None
    num_forks_pending: int = 0     # n - 1 siblings to fork when the prompt is done
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: object | None = None
    matcher: object | None = None  # structured outputs: its grammar matcher, advanced on each sampled token
    draft_ids: list[int] = field(default_factory=list)   # speculative decoding: proposed for its next step
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt position (vLLM's shape)

    def fork(self, index: int) -> Sequence:
        """Sibling `index` of a request's n: shares the prompt (and, in the KV manager, its blocks), draws its own
        seed, and samples from this sequence's logits of the step that completes the prompt."""
        seed = (self.seed + index) % 2**63 if self.params.seed is not None else stable_seed(self.seed, index)
        return Sequence(next_seq_id(), self.request_id, index, list(self.token_ids), self.num_prompt_tokens,
                        self.params, seed, self.priority, status=SequenceStatus.RUNNING,
                        num_computed_tokens=self.num_tokens, block_hashes=self.block_hashes,
                        cache_salt=self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def confirmed_output_ids(self) -> list[int]:
        """Output tokens already back on the host (pending ones sit at the tail)."""
        out = self.token_ids[self.num_prompt_tokens:]
        while out and out[-1] == PENDING:
            out.pop()
        return out

    def done_once_pending_lands(self, max_model_len: int) -> bool:
        """Its pending token reaches max_tokens or max_model_len: never schedule it again."""
        p, num_tokens = self.params, len(self.token_ids)
        return (p.max_tokens is not None and num_tokens - self.num_prompt_tokens >= p.max_tokens) or \
            num_tokens >= max_model_len

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict = field(default_factory=dict)   # arrival_time, first_token_time (time.monotonic; None before it)
