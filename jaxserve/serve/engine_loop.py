"""The engine's threads under `jaxserve serve`, shared by its front ends (gRPC and OpenAI HTTP).

An engine is synchronous and not thread-safe, so one thread owns it (Replica): it runs queued commands (add,
abort), steps while there is work and hands each step's outputs to a sink: the event loop, in one
`call_soon_threadsafe`, or (`jaxserve serve`'s default) the pipe of an engine process (engine_process.py), where the
engine threads never share a GIL with the front ends. Front ends read an engine only through EngineFacts.
With data parallelism there are several engines, each on its own devices and thread; EngineLoop sends a new
request to the least-loaded one, where it stays (its abort goes there too), and sums their stats. A replica whose
engine fails takes no more requests; the server fails once none is left. A second thread converts,
chat-templates and tokenizes requests, so neither an engine nor the event loop ever waits on a long prompt.
Handlers never touch an engine: they enqueue commands and await their request's asyncio queue. Outputs are
cumulative, so a handler that falls behind sends only the newest (as a delta). A handler that ends before its
request finished (client cancel or disconnect, expired deadline, shutdown) aborts it; the abort runs before the
next step, so the request's blocks are free within one step. Every THROUGHPUT_INTERVAL_S with activity, a log line
gives the interval's throughput, as vLLM's does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from jaxserve.serve.engine_process import EngineProcess

STOP = None   # the command that ends the engine thread
THROUGHPUT_INTERVAL_S = 10.0

log = logging.getLogger(__name__)


class EngineFailed(Exception):
    """The engine raised in a step: it serves nothing more (UNAVAILABLE)."""


class Overloaded(Exception):
    """Too many requests wait for their first token (RESOURCE_EXHAUSTED)."""


REFUSALS = (ValueError, Overloaded, EngineFailed)   # what a front end answers with an error status


@dataclass(slots=True)
class EngineFacts:
    """What the front ends read of an engine, picklable (an engine process sends it over): its tokenizer, configs,
    sampling defaults and device. tokenize and check_prompt_length are the engine's own (thread-safe)."""
    tokenizer: object | None
    cfg: EngineConfig
    model_config: ModelConfig
    dtype: str
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict
    device_kind: str

    tokenize = LLMEngine.tokenize
    check_prompt_length = LLMEngine.check_prompt_length

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        return cls(engine.tokenizer, engine.cfg, engine.loaded.config, str(engine.loaded.dtype),
                   tuple(engine.eos_token_ids), engine.sampling_defaults, jax.devices()[0].device_kind)


@dataclass(slots=True)
class Submission:
    """A request as the engine takes it, converted (and a text prompt tokenized) on the tokenizer thread."""
    prompt: str | list[int]
    token_ids: list[int] | None     # a text prompt's; None for a token-id prompt
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class Stream:
    replica: Replica                                              # the engine serving the request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # RequestOutputs, or the exception ending it
    started: bool = False     # has an output: no longer counts against max_waiting
    finished: bool = False
    num_tokens: int = 0       # output tokens, all choices together, as of the latest output


# engine stats that add up over replicas; the ratios are computed from the sums
SUMMED_STATS = ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_queries",
                "prefix_cache_hits", "preemptions", "compiled_graphs", "compiles_after_start", "engine_steps",
                "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


# engine stats every replica shares (its model's and cache's dtypes)
SHARED_STATS = ("weight_dtype", "kv_cache_dtype")


def summed_stats(snapshots: list[dict]) -> dict:
    s = {key: sum(snapshot[key] for snapshot in snapshots) for key in SUMMED_STATS}
    queries, total, free = s["prefix_cache_queries"], s["kv_blocks_total"], s["kv_blocks_free"]
    return {**s, **{key: snapshots[0][key] for key in SHARED_STATS}, "kv_blocks_used": total - free,
            "kv_usage": 1.0 - free / total,
            "prefix_cache_hit_rate": s["prefix_cache_hits"] / queries if queries else 0.0,
            "spec_mean_acceptance_length": 1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
            if s["spec_num_drafts"] else 0.0}


class EngineLoop:
    """Routes requests over the replicas' engines (one without data parallelism), each owned by its thread, in this
    process or in an engine process. Methods without a leading underscore run on the event loop; stepped, refused,
    aborted and failed are the replicas' sink here (on their threads)."""

    def __init__(self, engines: list[LLMEngine] | EngineProcess, max_waiting: int, on_failure: Callable):
        self.max_waiting, self.on_failure = max_waiting, on_failure
        self.loop: asyncio.AbstractEventLoop | None = None
        if isinstance(engines, list):
            self.process, self.facts = None, EngineFacts.of(engines[0])
            self.replicas = [Replica(i, engine, self) for i, engine in enumerate(engines)]
        else:
            self.process, self.replicas, self.facts = engines, engines.replicas, engines.facts
        self.streams: dict[str, Stream] = {}
        self.num_pending = 0
        self.failure: EngineFailed | None = None   # once no replica is left
        self.prompt_tokens = self.generation_tokens = 0   # of the outputs so far, for the throughput line
        self._ids = itertools.count()
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-tokenizer")
        self.throughput_log: asyncio.Task | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.process is not None:
            self.process.attach(self)
        else:
            for replica in self.replicas:
                replica.thread.start()
        self.throughput_log = asyncio.create_task(self.log_throughput())

    async def stop(self) -> None:
        self.throughput_log.cancel()
        for replica in self.replicas:
            replica.commands.put(STOP)
        joins = [self.process.join] if self.process is not None else [r.thread.join for r in self.replicas]
        await asyncio.gather(*(asyncio.to_thread(join) for join in joins))
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def off_engine(self, fn, *args):
        """fn(*args) on the tokenizer thread: request conversion, chat templates, (de)tokenization."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """A request's constraint compiled into every replica's engine (a ValueError naming the field if invalid),
        on the tokenizer thread: no engine thread stalls on compiling one, whichever replica the request goes to.
        With an engine process, a compiler here checks it, and the process compiles it as the request arrives."""
        if self.process is not None:
            self.process.grammars.compile(spec)
            return
        for replica in self.replicas:
            replica.engine.compile_grammar(spec)

    def prompt_ids(self, prompt: str | list[int]) -> list[int] | None:
        """A text prompt's token ids (None for token ids); on the tokenizer thread, inside a front end's conversion."""
        return self.facts.tokenize(prompt) if isinstance(prompt, str) else None

    async def generate(self, submission: Submission, timer) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs, the newest only when several queued up; `timer` counts how it ends.
        A refusal or failure raises; leaving early aborts the request at once."""
        request_id, out = None, None
        try:
            request_id, stream = self.open(submission)
            while out is None or not out.finished:
                out = await stream.queue.get()
                while not stream.queue.empty():
                    out = stream.queue.get_nowait()
                if isinstance(out, Exception):
                    raise out
                timer.observe(out)
                yield out
        except REFUSALS as e:
            timer.end(e)
            raise
        finally:
            self.close(request_id)   # None: never opened
            timer.end()

    def open(self, submission: Submission) -> tuple[str, Stream]:
        """Queue a request on the least-loaded replica and return the stream its outputs come on."""
        if self.failure is not None:
            raise self.failure
        if self.num_pending >= self.max_waiting:
            raise Overloaded(f"max_waiting={self.max_waiting} requests already wait for their first token; "
                             "retry later")
        replica = min((r for r in self.replicas if r.failure is None), key=lambda r: r.num_open)
        request_id = str(next(self._ids))
        self.streams[request_id] = stream = Stream(replica)
        self.num_pending += 1
        replica.num_open += 1
        replica.commands.put(("add", request_id, submission))
        return request_id, stream

    def close(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self.num_pending -= not stream.started
        stream.replica.num_open -= 1
        if not stream.finished:
            stream.replica.commands.put(("abort", request_id))
        if self.process is not None:
            self.process.forget(request_id)

    def stats(self) -> dict:
        """The serving replicas' latest stats summed (a failed one's last snapshot is stale; all when none is
        left), the server's backpressure count and health."""
        live = [r for r in self.replicas if r.failure is None]
        return {**summed_stats([r.snapshot for r in live or self.replicas]), "pending": self.num_pending,
                "serving": self.failure is None, "replicas_serving": len(live)}

    async def log_throughput(self) -> None:
        """Every THROUGHPUT_INTERVAL_S in which requests ran, waited or got tokens: the requests running and waiting,
        the interval's prompt and generation tokens/s (a prompt counts once its first token is out) and the KV cache
        usage. Nothing while idle."""
        since, counted = time.monotonic(), (0, 0)
        while True:
            await asyncio.sleep(THROUGHPUT_INTERVAL_S)
            now, counts, stats = time.monotonic(), (self.prompt_tokens, self.generation_tokens), self.stats()
            if counts != counted or stats["running"] or stats["waiting"]:
                log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                         "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                         (counts[0] - counted[0]) / (now - since), (counts[1] - counted[1]) / (now - since),
                         stats["running"], stats["waiting"], 100 * stats["kv_usage"])
            since, counted = now, counts

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:       # its call already ended; the abort is queued
                continue
            if not stream.started:
                stream.started = True
                self.num_pending -= 1
                self.prompt_tokens += len(out.prompt_token_ids)
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            self.generation_tokens += num_tokens - stream.num_tokens
            stream.num_tokens, stream.finished = num_tokens, out.finished
            stream.queue.put_nowait(out)

    # ---- the sink of the replicas in this process, on their threads ----
    def stepped(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def refused(self, request_id: str, error: ValueError) -> None:
        self.loop.call_soon_threadsafe(self._deliver_error, request_id, error)

    def aborted(self, request_id: str) -> None:
        pass

    def failed(self, replica: Replica, error: EngineFailed) -> None:
        asyncio.run_coroutine_threadsafe(self._fail(replica, error), self.loop)

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        if (stream := self.streams.get(request_id)) is not None:
            stream.queue.put_nowait(error)

    async def _fail(self, replica: Replica, error: EngineFailed) -> None:
        """A replica's engine failed: its requests end with the error and it takes no more; the server fails once
        no replica is left."""
        replica.failure = error
        for stream in self.streams.values():
            if stream.replica is replica:
                stream.queue.put_nowait(error)
        if serving := sum(r.failure is None for r in self.replicas):
            print(f"jaxserve serve: replica {replica.index} stopped ({error}); {serving} of {len(self.replicas)} "
                  "still serve", file=sys.stderr, flush=True)
            return
        self.failure = error
        await self.on_failure()


class Replica:
    """One engine and the thread that owns it; its outputs, refusals and failure go to its sink (EngineLoop, or an
    engine process's pipe)."""

    def __init__(self, index: int, engine: LLMEngine, sink):
        self.index, self.engine, self.sink = index, engine, sink
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: EngineFailed | None = None
        self.num_open = 0   # requests routed here whose calls have not ended: the router's measure of load
        self.steps = 0
        self.snapshot = self._stats()
        self.thread = threading.Thread(target=self._run, name=f"jaxserve-engine-{index}", daemon=True)

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                outputs = self._step() if self.engine.has_unfinished_requests() else []
                self.snapshot = self._stats()   # first: a client that saw these outputs sees these stats
                self.sink.stepped(self, outputs)
        except Exception as e:
            traceback.print_exc()
            error = EngineFailed(f"engine failed: {type(e).__name__}: {e}")
            self.sink.failed(self, error)
            self._refuse_all(error)

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        self.steps += 1
        return outputs

    def _drain(self, block: bool) -> bool:
        """Run the queued commands (waiting for one when idle); False once told to stop."""
        try:
            command = self.commands.get() if block else self.commands.get_nowait()
            while command is not STOP:
                self._execute(command)
                command = self.commands.get_nowait()
        except queue.Empty:
            return True
        return False

    def _execute(self, command: tuple) -> None:
        match command:
            case ("add", request_id, sub):
                try:
                    self.engine.add_request(sub.prompt, sub.params, request_id=request_id, priority=sub.priority,
                                            cache_salt=sub.cache_salt, prompt_token_ids=sub.token_ids)
                except ValueError as e:   # bad input: the engine is unchanged
                    self.sink.refused(request_id, e)
            case ("abort", request_id):
                self.engine.abort(request_id)
                self.sink.aborted(request_id)

    def _refuse_all(self, error: EngineFailed) -> None:
        """After a failure: answer every command with the error until told to stop, so no call hangs."""
        while (command := self.commands.get()) is not STOP:
            if command[0] == "add":
                self.sink.refused(command[1], error)

    def _stats(self) -> dict:
        s = self.engine.stats()
        return {**{key: s[key] for key in SUMMED_STATS + SHARED_STATS if key != "engine_steps"},
                "engine_steps": self.steps}
