"""A sequence: one generation stream (a request has n of them), and the vLLM-shaped outputs it becomes."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxserve.engine.sampling_params import SamplingParams


PENDING = -1   # a sampled token still on the device (async scheduling): always at the tail of token_ids


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True)
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
    slot: int = -1                 # persistent device row: block table, sampling state
    block_hashes: list[bytes] = field(default_factory=list)   # prefix-cache hashes, computed once
    cache_salt: str | None = None
    num_forks_pending: int = 0     # n - 1 siblings to fork when the prompt is done
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: object | None = None
    first_token_time: float | None = None
    pending_row: int = -1          # row of the latest launched step that samples this sequence's next token
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt position (vLLM's shape)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

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
        p = self.params
        return (p.max_tokens is not None and self.num_output_tokens >= p.max_tokens) or \
            self.num_tokens >= max_model_len

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict = field(default_factory=dict)
