"""`jaxserve serve`: a grpc.aio server (with health, reflection and Prometheus metrics) over one LLMEngine,
driven through its engine thread (engine_loop.py)."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sequence import RequestOutput
from jaxserve.models.loader import LoadedModel
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve import jaxserve_pb2_grpc as pb_grpc
from jaxserve.serve.convert import (delta_response, detokenize, full_response, model_info, request_prompt,
                                    sampling_params, tokenize)
from jaxserve.serve.engine_loop import EngineFailed, EngineLoop, Overloaded
from jaxserve.serve.metrics import RequestTimer, ServerMetrics

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9400
DEFAULT_MAX_WAITING = 512             # requests without a first token before RESOURCE_EXHAUSTED
DEFAULT_GRACE_PERIOD_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a 128k-token prompt as int64 ids is ~1 MiB
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name

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



def serve(opts: ServeOptions, loaded: LoadedModel, cfg: EngineConfig, model_name: str) -> None:
    """Serve until SIGTERM or SIGINT, then drain."""
    asyncio.run(serve_until_signal(LLMEngine(loaded, cfg), opts, model_name))
