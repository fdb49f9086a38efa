"""Prometheus metrics of `jaxserve serve` (both front ends, one registry): per-request latency histograms and
outcomes, and engine gauges read at scrape time from the engine loop's latest stats snapshot (so scraping never
touches an engine), summed over data-parallel replicas. Served at /metrics of the HTTP front end, and on
--metrics-port when asked. A request the engine served ends with an access-log line (RequestTimer.end)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest,
                               make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from jaxserve.engine.llm_engine import AdmissionError
from jaxserve.engine.sequence import RequestOutput
from jaxserve.serve.connections import bearer_matches
from jaxserve.serve.engine_loop import SHARED_STATS, EngineFailed, Overloaded

log = logging.getLogger(__name__)

# Bucket edges in seconds: TTFT spans queueing + prefill; per-token latencies span one engine step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# (metric name, help, key of the stats snapshot, is a counter)
ENGINE_METRICS = (
    ("jaxserve_num_requests_running", "Sequences in the running batch.", "running", False),
    ("jaxserve_num_requests_waiting", "Sequences queued in the engine.", "waiting", False),
    ("jaxserve_num_requests_pending", "Requests with no token yet (the backpressure count).", "pending", False),
    ("jaxserve_kv_cache_usage", "Fraction of KV-cache blocks in use.", "kv_usage", False),
    ("jaxserve_kv_blocks_used", "KV-cache blocks in use.", "kv_blocks_used", False),
    ("jaxserve_kv_blocks_free", "KV-cache blocks free (cached prefixes included).", "kv_blocks_free", False),
    ("jaxserve_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
     "prefix_cache_hit_rate", False),
    ("jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries", True),
    ("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits", True),
    ("jaxserve_preemptions", "Sequences preempted for lack of KV blocks.", "preemptions", True),
    ("jaxserve_compiled_graphs", "Graphs compiled so far.", "compiled_graphs", False),
    ("jaxserve_compiles_after_start", "Graphs compiled while serving (each stalls every stream; should stay 0).",
     "compiles_after_start", True),
    ("jaxserve_engine_steps", "Engine steps run.", "engine_steps", True),
    ("jaxserve_spec_decode_num_drafts", "Speculative decoding: rows that carried drafts.", "spec_num_drafts", True),
    ("jaxserve_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed.", "spec_num_draft_tokens",
     True),
    ("jaxserve_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_num_accepted_tokens", True),
    ("jaxserve_spec_decode_mean_acceptance_length", "Speculative decoding: tokens a drafted row emits per step "
     "(accepted drafts + 1).", "spec_mean_acceptance_length", False),
    ("jaxserve_serving", "1 while an engine is healthy and the server accepts requests.", "serving", False),
    ("jaxserve_replicas_serving", "Data-parallel replicas taking requests (engines that have not failed).",
     "replicas_serving", False),
)


# error -> outcome in the requests metric; the first that matches (an AdmissionError is a ValueError)
OUTCOMES = ((AdmissionError, "rejected"), (ValueError, "invalid"), (Overloaded, "rejected"), (EngineFailed, "failed"))


def outcome(error: Exception) -> str:
    return next(name for kind, name in OUTCOMES if isinstance(error, kind))


class EngineStatsCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        stats = self.snapshot()
        for name, doc, key, is_counter in ENGINE_METRICS:
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(name, doc, value=float(stats.get(key, 0)))
        info = GaugeMetricFamily("jaxserve_model_dtypes", "1, labelled with the dtypes the engine serves with: "
                                 "the linear layers' weights and the KV cache.", labels=SHARED_STATS)
        info.add_metric([str(stats.get(key, "")) for key in SHARED_STATS], 1.0)
        yield info


class ServerMetrics:
    """One registry per server (not the process-global one), so several servers can live in one process."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("jaxserve_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated.", registry=r)
        r.register(EngineStatsCollector(snapshot))
        self.http_server = None

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve_http(self, host: str, port: int, api_key: str | None = None) -> int:
        """Expose /metrics over HTTP in a daemon thread, behind `Authorization: Bearer <api_key>` when given;
        returns the bound port (port 0 picks a free one)."""
        app = make_wsgi_app(self.registry)
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {
            "address_family": socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]})
        self.http_server = make_server(host, port, app if api_key is None else wsgi_bearer(app, api_key),
                                       server_class, handler_class=QuietHandler)
        threading.Thread(target=self.http_server.serve_forever, name="jaxserve-metrics", daemon=True).start()
        return self.http_server.server_port

    def shutdown(self) -> None:
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()


class QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:   # a line per scrape on stderr
        pass


def wsgi_bearer(app, key: str):
    def guarded(environ, start_response):
        if bearer_matches(environ.get("HTTP_AUTHORIZATION"), key):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"Authorization: Bearer <api key> missing or wrong\n"]
    return guarded


@dataclass(slots=True)
class RequestTimer:
    """Latency and outcome bookkeeping of one request, fed with its cumulative outputs as they arrive."""
    metrics: ServerMetrics
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0        # tokens of the longest output so far (n > 1 outputs advance together)
    output: RequestOutput | None = None
    ended: bool = False

    def observe(self, out: RequestOutput) -> None:
        self.output = out
        num_tokens = max(len(c.token_ids) for c in out.outputs)
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(new):   # tokens coalesced into one message share the interval
                self.metrics.itl.observe((now - self.last) / new)
        self.last, self.num_tokens = now, num_tokens

    def end(self, error: Exception | None = None) -> None:
        """Count the request, once: refused or failed (error), finished, or aborted (left before it finished)."""
        if self.ended:
            return
        self.ended, m, out = True, self.metrics, self.output
        result = outcome(error) if error is not None else "finished" if out is not None and out.finished else "aborted"
        m.requests.labels(result).inc()
        if out is None:
            return
        output_tokens, duration = sum(len(c.token_ids) for c in out.outputs), time.perf_counter() - self.start
        m.generation_tokens.inc(output_tokens)
        self.log_access(out, result, output_tokens, duration)
        if result != "finished":
            return
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.e2e.observe(duration)
        if self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))

    def log_access(self, out: RequestOutput, result: str, output_tokens: int, duration: float) -> None:
        """The request's access-log line; a choice that did not finish shows how the request ended instead."""
        ttft = "-" if self.first is None else f"{self.first - self.start:.3f}s"
        log.info("request %s %s: prompt_tokens=%d output_tokens=%d ttft=%s duration=%.3fs finish_reason=%s",
                 out.request_id, result, len(out.prompt_token_ids), output_tokens, ttft, duration,
                 ",".join(c.finish_reason or result for c in out.outputs))
