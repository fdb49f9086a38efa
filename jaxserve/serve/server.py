"""`jaxserve serve`: a grpc.aio server over one LLMEngine.

The engine is synchronous and not thread-safe, so one thread owns it (EngineLoop): it runs queued commands
(add, abort, call), steps while there is work and hands each step's outputs to the event loop in one
`call_soon_threadsafe`. gRPC handlers never touch the engine: they enqueue commands and await their request's
asyncio queue. Outputs are cumulative, so a handler that falls behind sends only the newest (as a delta).
A handler that ends before its request finished (client cancel, expired deadline, shutdown) aborts it; the
abort runs before the next step, so the request's blocks are free within one engine step.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.models.loader import LoadedModel, load_run
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serve.metrics import RequestTimer, ServerMetrics

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9400
DEFAULT_MAX_WAITING = 512             # requests without a first token before RESOURCE_EXHAUSTED
DEFAULT_GRACE_PERIOD_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a 128k-token prompt as int64 ids is ~1 MiB
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "min_prefill_chunk", "num_blocks")
STOP = None                           # the command that ends the engine thread


class EngineFailed(Exception):
    """The engine raised in a step: it serves nothing more (UNAVAILABLE)."""


class Overloaded(Exception):
    """Too many requests wait for their first token (RESOURCE_EXHAUSTED)."""


# error -> (status of the call, outcome in the requests metric)
ERRORS = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT, "invalid"),
          (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected"),
          (EngineFailed, grpc.StatusCode.UNAVAILABLE, "failed"))


@dataclass(slots=True)
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT                            # 0: any free port
    metrics_port: int | None = DEFAULT_METRICS_PORT     # 0: any free port; None: no metrics endpoint
    max_waiting: int = DEFAULT_MAX_WAITING
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: str | None = None                         # PEM files; both or neither
    tls_key: str | None = None

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {value}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")


@dataclass(slots=True)
class Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # RequestOutputs, or the exception ending it
    started: bool = False     # has an output: no longer counts against max_waiting
    finished: bool = False


# ---- the engine thread --------------------------------------------------------------------------------
class EngineLoop:
    """Owns the engine in one thread. Methods without a leading underscore run on the event loop."""

    def __init__(self, engine: LLMEngine, max_waiting: int, on_failure: Callable):
        self.engine, self.max_waiting, self.on_failure = engine, max_waiting, on_failure
        self.loop: asyncio.AbstractEventLoop | None = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}
        self.num_pending = 0
        self.failure: EngineFailed | None = None
        self.steps = 0
        self.snapshot = self._stats()
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    async def stop(self) -> None:
        self.commands.put(STOP)
        await asyncio.to_thread(self.thread.join)

    def open(self, prompt, params: SamplingParams, priority: int, cache_salt: str | None) -> tuple[str, Stream]:
        if self.failure is not None:
            raise self.failure
        if self.num_pending >= self.max_waiting:
            raise Overloaded(f"max_waiting={self.max_waiting} requests already wait for their first token; "
                             "retry later")
        request_id = str(next(self._ids))
        self.streams[request_id] = stream = Stream()
        self.num_pending += 1
        self.commands.put(("add", request_id, prompt, params, priority, cache_salt))
        return request_id, stream

    def close(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self.num_pending -= not stream.started
        if not stream.finished:
            self.commands.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread between steps."""
        if self.failure is not None:
            raise self.failure
        future = self.loop.create_future()
        self.commands.put(("call", fn, future))
        return await future

    def stats(self) -> dict:
        return {**self.snapshot, "pending": self.num_pending, "serving": self.failure is None}

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:       # its call already ended; the abort is queued
                continue
            if not stream.started:
                stream.started = True
                self.num_pending -= 1
            stream.finished = out.finished
            stream.queue.put_nowait(out)

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        if (stream := self.streams.get(request_id)) is not None:
            stream.queue.put_nowait(error)

    async def _fail(self, error: EngineFailed) -> None:
        self.failure = error
        for stream in self.streams.values():
            stream.queue.put_nowait(error)
        await self.on_failure()

    # ---- engine thread side -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                outputs = self._step() if self.engine.has_unfinished_requests() else []
                self.snapshot = self._stats()   # first: a client that saw these outputs sees these stats
                if outputs:
                    self.loop.call_soon_threadsafe(self._dispatch, outputs)
        except Exception as e:
            traceback.print_exc()
            error = EngineFailed(f"engine failed: {type(e).__name__}: {e}")
            asyncio.run_coroutine_threadsafe(self._fail(error), self.loop)
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
            case ("add", request_id, prompt, params, priority, cache_salt):
                try:
                    self.engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                            cache_salt=cache_salt)
                except ValueError as e:   # bad input: the engine is unchanged
                    self.loop.call_soon_threadsafe(self._deliver_error, request_id, e)
            case ("abort", request_id):
                self.engine.abort(request_id)
            case ("call", fn, future):
                try:
                    result, error = fn(self.engine), None
                except ValueError as e:
                    result, error = None, e
                self.loop.call_soon_threadsafe(settle, future, result, error)

    def _refuse_all(self, error: EngineFailed) -> None:
        """After a failure: answer every command with the error until told to stop, so no call hangs."""
        while (command := self.commands.get()) is not STOP:
            match command:
                case ("add", request_id, *_):
                    self.loop.call_soon_threadsafe(self._deliver_error, request_id, error)
                case ("call", _, future):
                    self.loop.call_soon_threadsafe(settle, future, None, error)

    def _stats(self) -> dict:
        s = self.engine.stats()
        queries = s["prefix_cache_queries"]
        return {**{k: s[k] for k in ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "kv_usage",
                                     "prefix_cache_queries", "prefix_cache_hits", "preemptions",
                                     "compiled_buckets")},
                "kv_blocks_used": s["kv_blocks_total"] - s["kv_blocks_free"],
                "prefix_cache_hit_rate": s["prefix_cache_hits"] / queries if queries else 0.0,
                "engine_steps": self.steps}


def settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():            # its call was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


# ---- protobuf <-> engine ------------------------------------------------------------------------------
def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """Set fields only; the rest take SamplingParams' defaults. SamplingParams validates (ValueError)."""
    kwargs = {f.name: v if isinstance(v, (bool, int, float, str)) else list(v) for f, v in options.ListFields()}
    return SamplingParams(**kwargs)


def request_prompt(request: pb.GenerateRequest) -> str | list[int]:
    if request.prompt and request.prompt_token_ids:
        raise ValueError("prompt and prompt_token_ids: give one, not both")
    return list(request.prompt_token_ids) if request.prompt_token_ids else request.prompt


def token_logprobs(token: int, logprobs: dict[int, float]) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.items()]
    return pb.TokenLogprobs(token_id=token, logprob=logprobs[token], top=top)


def completion_chunk(c: CompletionOutput, text_from: int = 0, tokens_from: int = 0) -> pb.CompletionChunk:
    ids = c.token_ids[tokens_from:]
    chunk = pb.CompletionChunk(index=c.index, text=c.text[text_from:], token_ids=ids,
                               finish_reason=c.finish_reason or "")
    if c.logprobs is not None:   # the engine's list keeps growing: cut it at this output's length
        chunk.logprobs.extend(map(token_logprobs, ids, c.logprobs[tokens_from:len(c.token_ids)]))
    if isinstance(c.stop_reason, str):
        chunk.stop_str = c.stop_reason
    elif isinstance(c.stop_reason, int):
        chunk.stop_token_id = c.stop_reason
    return chunk


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in out.outputs))


def delta_response(out: RequestOutput, sent: dict[int, tuple[int, int, bool]]) -> pb.GenerateResponse:
    """What changed since `sent` (index -> chars, tokens, finished already sent), which it updates."""
    response = pb.GenerateResponse(request_id=out.request_id, finished=out.finished)
    for c in out.outputs:
        chars, tokens, done = sent.get(c.index, (0, 0, False))
        if len(c.text) > chars or len(c.token_ids) > tokens or (c.finish_reason is not None and not done):
            response.outputs.append(completion_chunk(c, chars, tokens))
            sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
    if out.finished:
        response.usage.CopyFrom(usage(out))
        response.prompt_logprobs.extend(prompt_logprobs(out))
    return response


def full_response(out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=out.request_id, finished=out.finished,
                               outputs=[completion_chunk(c) for c in out.outputs], usage=usage(out),
                               prompt_logprobs=prompt_logprobs(out))


def prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprobs]:
    """Prompt tokens from the second on (the first has no context), each with its top-k."""
    if out.prompt_logprobs is None:
        return []
    return [token_logprobs(t, lp) for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def tokenize(engine: LLMEngine, text: str, add_special_tokens: bool) -> list[int]:
    if engine.tokenizer is None:
        raise ValueError("text: this model has no tokenizer")
    return engine.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def detokenize(engine: LLMEngine, ids: list[int], skip_special_tokens: bool) -> str:
    vocab = engine.loaded.config.vocab_size
    if engine.tokenizer is None:
        raise ValueError("token_ids: this model has no tokenizer")
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token_ids must be in [0, {vocab})")
    return engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def model_info(engine: LLMEngine, model_name: str) -> pb.ModelInfoResponse:
    mc, cfg = engine.loaded.config, engine.cfg
    return pb.ModelInfoResponse(
        model=model_name, arch=mc.arch, dtype=str(engine.loaded.model.embed_tokens.embedding[...].dtype),
        device=jax.devices()[0].device_kind, vocab_size=mc.vocab_size, max_model_len=cfg.max_model_len,
        num_layers=mc.num_layers, hidden_size=mc.hidden_size, num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, eos_token_ids=engine.runner.eos_token_ids,
        has_tokenizer=engine.tokenizer is not None, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens)


# ---- the service --------------------------------------------------------------------------------------
class JaxServeServicer(pb_grpc.JaxServeServicer):
    def __init__(self, engine_loop: EngineLoop, info: pb.ModelInfoResponse, metrics: ServerMetrics):
        self.engine_loop, self.info, self.metrics = engine_loop, info, metrics

    async def Generate(self, request, context):
        sent: dict[int, tuple[int, int, bool]] = {}
        async with contextlib.aclosing(self._outputs(request, context)) as outputs:   # a cancel aborts at once
            async for out in outputs:
                yield delta_response(out, sent)

    async def Complete(self, request, context):
        async with contextlib.aclosing(self._outputs(request, context)) as outputs:
            async for last in outputs:
                pass
        return full_response(last)

    async def Tokenize(self, request, context):
        ids = await self._call(context, lambda e: tokenize(e, request.text, request.add_special_tokens))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        ids = list(request.token_ids)
        text = await self._call(context, lambda e: detokenize(e, ids, request.skip_special_tokens))
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request, context):
        return self.info

    async def ServerStats(self, request, context):
        return pb.ServerStatsResponse(**self.engine_loop.stats())

    async def _outputs(self, request, context) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs, newest only when several queued up; errors end the call."""
        timer = RequestTimer(self.metrics)
        try:
            prompt, params = request_prompt(request), sampling_params(request.sampling)
            cache_salt = request.cache_salt if request.HasField("cache_salt") else None
            request_id, stream = self.engine_loop.open(prompt, params, request.priority, cache_salt)
        except (ValueError, Overloaded, EngineFailed) as e:
            timer.finish(classify(e)[1])
            await abort(context, e)
        outcome, out = "aborted", None
        try:
            while out is None or not out.finished:
                out = await stream.queue.get()
                while not stream.queue.empty():
                    out = stream.queue.get_nowait()
                if isinstance(out, Exception):
                    outcome = classify(out)[1]
                    await abort(context, out)
                timer.observe(max(len(c.token_ids) for c in out.outputs))
                yield out
            outcome = "finished"
        finally:
            self.engine_loop.close(request_id)
            done = isinstance(out, RequestOutput)
            timer.finish(outcome, len(out.prompt_token_ids) if done else 0,
                         sum(len(c.token_ids) for c in out.outputs) if done else 0)

    async def _call(self, context, fn):
        try:
            return await self.engine_loop.call(fn)
        except (ValueError, EngineFailed) as e:
            await abort(context, e)


def classify(error: Exception) -> tuple[grpc.StatusCode, str]:
    return next((code, outcome) for kind, code, outcome in ERRORS if isinstance(error, kind))


async def abort(context, error: Exception):
    await context.abort(classify(error)[0], str(error))


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """The gRPC server, health and reflection services, metrics endpoint and engine thread of one engine."""

    def __init__(self, engine: LLMEngine, opts: ServeOptions, model_name: str):
        self.opts = opts
        self.health = health.aio.HealthServicer()
        self.engine_loop = EngineLoop(engine, opts.max_waiting, self._set_not_serving)
        self.metrics = ServerMetrics(self.engine_loop.stats)
        self.servicer = JaxServeServicer(self.engine_loop, model_info(engine, model_name), self.metrics)
        self.grpc: grpc.aio.Server | None = None
        self.port = self.metrics_port = None

    async def start(self) -> None:
        opts = self.opts
        self.grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", opts.max_message_bytes),
                                             ("grpc.max_send_message_length", opts.max_message_bytes),
                                             ("grpc.so_reuseport", 0)])
        pb_grpc.add_JaxServeServicer_to_server(self.servicer, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        self.port = self._bind(address(opts.host, opts.port))
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.engine_loop.start()
        await self.grpc.start()
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(opts.host, opts.metrics_port)

    def _bind(self, addr: str) -> int:
        if self.opts.tls_cert is None:
            return self.grpc.add_insecure_port(addr)
        with open(self.opts.tls_key, "rb") as key, open(self.opts.tls_cert, "rb") as cert:
            return self.grpc.add_secure_port(addr, grpc.ssl_server_credentials([(key.read(), cert.read())]))

    async def stop(self) -> None:
        """Drain: health NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period
        (the rest are cancelled, which aborts their requests), then stop the engine thread."""
        await self.health.enter_graceful_shutdown()
        await self.grpc.stop(self.opts.grace_period_s)
        await self.engine_loop.stop()
        self.metrics.shutdown()

    async def _set_not_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


# ---- the command line ---------------------------------------------------------------------------------
def load_served_model(args) -> tuple[LoadedModel, EngineConfig, str]:
    """The model and engine config from --model / --config (whose `model: random` builds random weights)
    with the engine flags on top."""
    loaded, engine = load_run(args.model, args.config, args.dtype)
    name = loaded.source if args.config else args.model
    knobs = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.no_precompile:
        knobs["precompile"] = False
    return loaded, replace(engine, **knobs), name


def serve_options(args) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, metrics_port=None if args.no_metrics else args.metrics_port,
                        max_waiting=args.max_waiting, grace_period_s=args.grace_period,
                        max_message_bytes=args.max_message_bytes, tls_cert=args.tls_cert, tls_key=args.tls_key)


async def serve_until_signal(engine: LLMEngine, opts: ServeOptions, model_name: str) -> None:
    server = Server(engine, opts, model_name)
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    metrics = f" metrics=http://{address(opts.host, server.metrics_port)}/metrics" if server.metrics_port else ""
    print(f"jaxserve serve: ready grpc={address(opts.host, server.port)}{metrics}", file=sys.stderr, flush=True)
    await stop.wait()
    print(f"jaxserve serve: draining (grace {opts.grace_period_s:g} s)", file=sys.stderr, flush=True)
    await server.stop()
    print("jaxserve serve: stopped", file=sys.stderr, flush=True)


def cmd_serve(args) -> None:
    opts = serve_options(args)   # bad flags fail before the model loads
    loaded, cfg, name = load_served_model(args)
    asyncio.run(serve_until_signal(LLMEngine(loaded, cfg), opts, name))


def add_parser(sub) -> None:
    from jaxserve.cli import add_model_args
    p = sub.add_parser("serve", help="serve the model over gRPC (health, reflection, Prometheus metrics)")
    add_model_args(p)
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="Prometheus port (0: any free)")
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus endpoint")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests without a first token before new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD_S,
                   help="seconds in-flight calls get to finish on SIGTERM")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    for name in ENGINE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="engine knob (overrides --config)")
    p.add_argument("--no-precompile", action="store_true", help="compile step graphs on first use")
    p.set_defaults(func=cmd_serve)
