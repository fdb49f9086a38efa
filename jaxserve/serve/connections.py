"""Connection hygiene of the HTTP front end: uvicorn's h11 protocol with a cap on open connections, a deadline for
a request's headers and a write timeout, plus the process-wide parts (the file-descriptor limit, quiet accept
failures). Without them a client holds a handler forever by trickling headers, never reading its stream, or
opening idle sockets until the process (gRPC and metrics included) has no descriptor left. The body's deadline is
the app's (openai_http.read_body): headers are parsed here, a body is read by the handler."""
from __future__ import annotations

import asyncio
import json
import resource
import secrets
import sys
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_WRITE_TIMEOUT_S = 60.0
WARN_EVERY_S = 10.0
# Each accepted socket's kernel send buffer. Autotuned it grows to tcp_wmem's max (often 4 MiB) for a client that
# reads nothing, which then pins that much kernel memory and takes that long to reach the write timeout. Token
# streams need little; a large JSON response still flows at this over the round trip.
SEND_BUFFER_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS   # open HTTP connections; more are answered 503 and closed
    # a request's headers, then its body, each within this; an idle kept-alive connection waits as long for the
    # next request's. Clients' pools drop idle connections sooner (httpx 5 s, aiohttp 15 s): a server closing
    # first races a client reusing the connection, whose request then meets a reset.
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a response whose client reads nothing this long is cut

    def __post_init__(self):
        if self.max_connections < 1:
            raise ValueError(f"http_max_connections must be >= 1, got {self.max_connections}")
        for name in ("read_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"http_{name} must be > 0, got {getattr(self, name)}")


class RateLimitedWarning:
    """A repeated condition as one stderr line per WARN_EVERY_S, saying how often it was left unsaid."""

    def __init__(self, message: str):
        self.message, self.unsaid, self.last = message, 0, -WARN_EVERY_S

    def __call__(self) -> None:
        if (now := time.monotonic()) - self.last < WARN_EVERY_S:
            self.unsaid += 1
            return
        unsaid = f" ({self.unsaid} more since the last warning)" if self.unsaid else ""
        print(f"jaxserve serve: {self.message}{unsaid}", file=sys.stderr, flush=True)
        self.last, self.unsaid = now, 0


BUSY_BODY = json.dumps({"error": {"message": "too many open connections; retry later", "type": "service_unavailable",
                                  "param": None, "code": "too_many_connections"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under ConnectionLimits (set on the subclass guarded_protocol makes)."""
    limits: ConnectionLimits
    warn_busy: RateLimitedWarning
    warn_stalled: RateLimitedWarning

    def connection_made(self, transport) -> None:
        self.header_timer = self.write_timer = None
        self.refused = len(self.connections) >= self.limits.max_connections
        if self.refused:
            self.warn_busy()
            transport.write(BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc) -> None:
        if self.refused:
            return
        for timer in (self.header_timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and self._between_requests():
            self._await_headers()
        super().data_received(data)
        if self.header_timer is not None and not self._between_requests():   # the headers are in
            self.header_timer.cancel()
            self.header_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        self.write_timer = self.loop.call_later(self.limits.write_timeout_s, self._cut, self.warn_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _await_headers(self) -> None:
        self.header_timer = self.loop.call_later(self.limits.read_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self.header_timer = None
        if self._between_requests():   # a pipelined request may have started without new data
            self.transport.abort()

    def _cut(self, warn: RateLimitedWarning) -> None:
        """Drop the connection now (close() would wait for a buffer the client never drains); uvicorn then sees
        a disconnect, which ends the handler and aborts its request."""
        self.write_timer = None
        warn()
        self.transport.abort()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "limits": limits, "warn_busy": RateLimitedWarning(f"HTTP: {limits.max_connections} connections open, "
                                                          "refusing more (--http-max-connections)"),
        "warn_stalled": RateLimitedWarning(f"HTTP: a client read nothing for {limits.write_timeout_s:g} s; "
                                           "its response was cut and its request aborted (--http-write-timeout)")})


def bearer_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>` (an HTTP header or gRPC metadata), the scheme in any case (RFC 7235)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def raise_fd_limit() -> int:
    """The soft limit on open files raised to the hard one (often 1,024 of 1M+): every connection is one. The
    limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def quiet_accept_failures(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio reports every failed accept (out of descriptors: retried each second per listening socket) with a
    traceback; one rate-limited line says it instead. Other reports keep the default handler."""
    warn = RateLimitedWarning("out of file descriptors: new connections wait in the backlog until some close "
                              "(raise `ulimit -n`, or lower --http-max-connections)")

    def handle(loop, context: dict) -> None:
        if "out of system resource" in context.get("message", ""):
            warn()
        else:
            loop.default_exception_handler(context)
    loop.set_exception_handler(handle)
