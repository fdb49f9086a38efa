"""`jaxserve serve`: its options, and the server that runs the engine loop (engine_loop.py: one LLMEngine, or one per
data-parallel replica, each on its thread, in this process or in an engine process (engine_process.py), and a
tokenizer thread) under two APIs in one event loop: OpenAI-compatible
HTTP (openai_http.py, with Prometheus /metrics) and, unless turned off, gRPC (grpc_api.py, on a grpc.aio server with
health and reflection); a standalone metrics port when asked, and the signals that drain it. Once every engine
failed, health turns NOT_SERVING (HTTP /health 503) and the process exits 1."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.serve.engine_process import EngineProcess
from jaxserve.serve.connections import ConnectionLimits, raise_fd_limit
from jaxserve.serve.engine_loop import EngineLoop
from jaxserve.serve.grpc_api import SERVICE_NAME, JaxServeServicer, grpc_server
from jaxserve.serve.metrics import ServerMetrics
from jaxserve.serve.openai_http import HttpServer, OpenAIApp
from jaxserve.serve.tool_calls import TOOL_PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000           # HTTP, vLLM's
DEFAULT_GRPC_PORT = 50051
DEFAULT_MAX_WAITING = 512             # requests without a first token before RESOURCE_EXHAUSTED
DEFAULT_GRACE_PERIOD_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a 128k-token prompt as int64 ids is ~1 MiB
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class ServeOptions:
    host: str = DEFAULT_HOST
    http_port: int = DEFAULT_PORT                       # the OpenAI-compatible HTTP server, always on; 0: any free
    grpc_port: int | None = DEFAULT_GRPC_PORT           # 0: any free port; None: no gRPC server
    metrics_port: int | None = None                     # a standalone Prometheus server, besides the HTTP /metrics
    http_metrics: bool = True                           # /metrics on the HTTP server
    max_waiting: int = DEFAULT_MAX_WAITING
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: str | None = None                         # PEM files; both or neither
    tls_key: str | None = None
    scheduling_policy: str = "fcfs"                     # "priority": requests' priority orders the queue
    reflection: bool = True
    api_key: str | None = None                          # required as `Authorization: Bearer` (gRPC, HTTP, metrics)
    allowed_origins: tuple[str, ...] = ()               # browser origins the HTTP server serves (CORS); "*": any
    tool_call_parser: str | None = None                 # tool_choice auto's; None: as the chat template tells
    http_limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self):
        taken = {}
        for flag, port in self.ports():
            if not 0 <= port < 65536:
                raise ValueError(f"{flag} must be in [0, 65536), got {port}")
            if port in taken:
                raise ValueError(f"{flag} {port}: the same port as {taken[port]}")
            if port:   # 0 picks a free port for each server
                taken[port] = flag
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_cert is not None and self.grpc_port is None:
            raise ValueError("tls_cert: TLS serves gRPC only, and there is no gRPC server")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if bad := [o for o in self.allowed_origins if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o)]:
            raise ValueError(f"allowed_origins: {bad[0]!r} is not an origin (scheme://host[:port], or *)")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")

    def read_tls(self) -> tuple[bytes, bytes] | None:
        """(key, certificate chain) PEM bytes, or None without TLS; a missing or non-PEM file is a ValueError."""
        if self.tls_cert is None:
            return None
        pems = []
        for flag, path in (("--tls-key", self.tls_key), ("--tls-cert", self.tls_cert)):
            try:
                data = open(path, "rb").read()
            except OSError as e:
                raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
            if b"-----BEGIN" not in data:
                raise ValueError(f"{flag} {path}: not a PEM file")
            pems.append(data)
        return pems[0], pems[1]

    def ports(self) -> list[tuple[str, int]]:
        """(flag, port) of each server to start."""
        ports = (("--port", self.http_port), ("--grpc-port", self.grpc_port), ("--metrics-port", self.metrics_port))
        return [(flag, port) for flag, port in ports if port is not None]

    def check_bindable(self) -> None:
        """Before the model loads: the host resolves and the ports are free (a ValueError naming which)."""
        for flag, port in self.ports():
            try:
                family = socket.getaddrinfo(self.host, port, type=socket.SOCK_STREAM)[0][0]
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    # as the servers bind: a port left in TIME-WAIT by a drained server is free to them
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((self.host, port))
            except OSError as e:
                raise ValueError(f"{flag} {port} on --host {self.host}: cannot bind ({e.strerror or e})") from None


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """The OpenAI HTTP server, the gRPC server with its health and reflection services (unless opts.grpc_port is None),
    the standalone metrics endpoint (with opts.metrics_port) and the engine threads of one engine, or of each
    data-parallel replica's (a list of engines of one model, or the engine process running them)."""

    def __init__(self, engines: list[LLMEngine] | EngineProcess, opts: ServeOptions, model_names: tuple[str, ...]):
        """model_names: the names requests may give the model; responses and model info give the first."""
        self.opts = opts
        self.health = health.aio.HealthServicer()
        self.engine_loop = EngineLoop(engines, opts.max_waiting, self._on_engine_failure)
        self.metrics = ServerMetrics(self.engine_loop.stats)
        self.servicer = JaxServeServicer(self.engine_loop, self.metrics, model_names[0], opts.scheduling_policy)
        self.openai = OpenAIApp(self.engine_loop, self.metrics, model_names, opts.api_key, opts.max_message_bytes,
                                opts.http_limits.read_timeout_s, opts.allowed_origins, opts.http_metrics,
                                opts.tool_call_parser)
        self.http = HttpServer(self.openai.app, opts.host, opts.http_port, opts.grace_period_s, opts.http_limits)
        self.grpc: grpc.aio.Server | None = None
        self.grpc_port = self.metrics_port = self.http_port = None   # as bound
        self.failed = asyncio.Event()   # the engine failed: the process should exit non-zero

    async def start(self) -> None:
        opts = self.opts
        if opts.grpc_port is not None:
            self.grpc_port = self._bind_grpc()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.engine_loop.start()
        if self.grpc is not None:
            await self.grpc.start()
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(opts.host, opts.metrics_port, opts.api_key)
        self.http_port = await self.http.start()

    def _bind_grpc(self) -> int:
        """The gRPC server with its services, bound (TLS with opts' files); its port."""
        opts = self.opts
        self.grpc = grpc_server(self.servicer, opts.api_key, opts.max_message_bytes)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        if opts.reflection:
            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                                self.grpc)
        addr, tls = address(opts.host, opts.grpc_port), opts.read_tls()
        if tls is None:
            return self.grpc.add_insecure_port(addr)
        return self.grpc.add_secure_port(addr, grpc.ssl_server_credentials([tls]))

    async def stop(self) -> None:
        """Drain: health NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period
        (the rest are cancelled, which aborts their requests), then stop the engine threads."""
        await self.health.enter_graceful_shutdown()
        grpc_stop = [] if self.grpc is None else [self.grpc.stop(self.opts.grace_period_s)]
        await asyncio.gather(self.http.stop(), *grpc_stop)
        await self.engine_loop.stop()
        self.metrics.shutdown()

    async def _on_engine_failure(self) -> None:
        """Every engine failed: NOT_SERVING, and the process exits 1."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.failed.set()


async def serve_until_signal(engines: list[LLMEngine] | EngineProcess, opts: ServeOptions,
                             model_names: tuple[str, ...]) -> int:
    """Serve until SIGTERM/SIGINT (a second one exits at once) or every engine failed; the exit code."""
    raise_fd_limit()
    server = Server(engines, opts, model_names)
    await server.start()
    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_then_force, stop)
    grpc_api = f" grpc={address(opts.host, server.grpc_port)}" if server.grpc_port else ""
    metrics = f" metrics=http://{address(opts.host, server.metrics_port)}/metrics" if server.metrics_port else ""
    print(f"jaxserve serve: ready{grpc_api} http=http://{address(opts.host, server.http_port)}/v1{metrics}",
          file=sys.stderr, flush=True)
    await asyncio.wait([asyncio.create_task(stop.wait()), asyncio.create_task(server.failed.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if server.failed.is_set():
        print(f"jaxserve serve: {server.engine_loop.failure}; stopping (exit 1)", file=sys.stderr, flush=True)
    print(f"jaxserve serve: draining (grace {opts.grace_period_s:g} s)", file=sys.stderr, flush=True)
    await server.stop()
    print("jaxserve serve: stopped", file=sys.stderr, flush=True)
    return 1 if server.failed.is_set() else 0


def stop_then_force(stop: asyncio.Event) -> None:
    """First signal: drain. Second: exit now (the drain may wait on a stuck device)."""
    if stop.is_set():
        print("jaxserve serve: second signal, exiting without draining", file=sys.stderr, flush=True)
        os._exit(130)
    stop.set()


def serve(opts: ServeOptions, engines: list[LLMEngine] | EngineProcess, model_names: tuple[str, ...]) -> int:
    """Serve until SIGTERM or SIGINT, then drain; 1 if every engine failed."""
    return asyncio.run(serve_until_signal(engines, opts, model_names))
