"""Online serving load through the gRPC server, like `vllm bench serve`: requests arrive as a Poisson process
(--request-rate, `inf`: all at once) under a cap on requests in flight (--max-concurrency); each point of the
sweep (rate x concurrency) reports throughput and TTFT / TPOT / ITL / end-to-end latency p50 / p99.

--protocol grpc http runs each point once per protocol, back to back, against the same server (which serves
both): the HTTP pass streams the same requests through the OpenAI API (/v1/completions, server-sent
events, with vLLM's extra fields ignore_eos, cache_salt and return_token_ids, so that each chunk's time is split
over the tokens it carries as a gRPC message's is; the closing usage chunk must count them). Rows carry
`protocol`; an HTTP row also `vs_grpc_pct`, its relative difference from the gRPC row of its point (throughput,
TTFT / TPOT / ITL p50), which the summary prints. Each protocol has its own prefix-cache namespace (cache salt),
warmed just before its first point, and the passes alternate, so each meets the cache as the other does.

Datasets are built and iterated with grain: `random` (uniform lengths around --input-len / --output-len),
`prefix` (one --prefix-len shared prefix + a random --input-len suffix: the prefix cache at work) or
`sharegpt` (a ShareGPT-format JSON file: first human turn as prompt, the reply's token count as output length).
Outputs are greedy with EOS ignored so that every request generates exactly its output length.

--invalid-frac F ... adds, interleaved with the valid requests, invalid ones in that share of all requests (the
ways a bad client errs: top_p 1.5, max_tokens 0, temperature -1, n 0, a token id out of the vocabulary or
negative, an empty prompt, a prompt longer than max_model_len, in turn). Each must fail fast with
INVALID_ARGUMENT; the valid requests stay the same at every fraction and alone make throughput and latency, so
the rows show whether invalid traffic slows valid traffic. Every point reuses the same prompts, so the valid
requests (warm-up included, just before the fraction's first point) of each F > 0 carry their own cache salt:
each fraction meets the prefix cache as F = 0 does. A point
with F > 0 gets `invalid_frac` in params, `invalid_rejected` (INVALID_ARGUMENT; over HTTP, 400), `invalid_errors`
(any other end, by status) and `reject_*_ms` (time to the rejection).

The script starts `jaxserve serve` itself (--config / --model / --server-args pass through; its engine
precompiles before the ready line) and stops it with SIGTERM, unless --target names a running server (and
--http-target its OpenAI API, for --protocol http).

  python benchmarks/serve_load.py --num-prompts 64 --input-len 128 --output-len 32 --max-concurrency 1 4 8 \
      --server-args "--max-num-seqs 16 --max-model-len 1024 --num-blocks 512"                  # CPU, SmolLM2
  python benchmarks/serve_load.py --config configs/llama3-8b-random.yaml --num-prompts 512 --input-len 512 \
      --output-len 128 --max-concurrency 256 --request-rate 4 16 inf                          # one H100
  python benchmarks/serve_load.py --num-prompts 16 --input-len 32 --output-len 8 --max-concurrency 4 \
      --invalid-frac 0 0.25 --server-args "--max-num-seqs 8 --max-model-len 512 --num-blocks 256" \
      --out /tmp/serve_smoke.json                                             # CPU, invalid traffic (smoke)
  python benchmarks/serve_load.py --config configs/llama3-8b-random.yaml --num-prompts 512 --input-len 512 \
      --output-len 128 --max-concurrency 256 --invalid-frac 0 0.2 0.5 \
      --out benchmarks/results/serve_invalid_gpu.json                         # one H100, invalid traffic
  python benchmarks/serve_load.py --num-prompts 16 --input-len 32 --output-len 8 --max-concurrency 4 \
      --protocol grpc http --server-args "--max-num-seqs 8 --max-model-len 512 --num-blocks 256" \
      --out /tmp/serve_http_smoke.json                                        # CPU, gRPC and HTTP (smoke)
  python benchmarks/serve_load.py --config configs/llama3-8b-random.yaml --num-prompts 512 --input-len 512 \
      --output-len 128 --max-concurrency 256 --request-rate 8 32 inf --protocol grpc http \
      --out benchmarks/results/serve_http_gpu.json                            # one H100, HTTP beside gRPC

Per request: TTFT = first token - send; TPOT = (last - first token) / (output tokens - 1); ITL = gap between
consecutive messages (HTTP: chunks), split evenly over the tokens a message carries. Every request must generate
exactly its output length (`wrong_length` counts those that did not). Rows:
benchmarks/results/serve_<backend>.json (`ms` = wall time of the point, `tok_s` = output tokens / wall) and a PNG
beside it. The HTTP client is the standard library's asyncio streams (HttpClient says why).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

SERVER_ENV = dict(os.environ)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # this process must not claim the server's GPU

import grain  # noqa: E402
import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import write_rows  # noqa: E402
from jaxserve.client import Client, generate_request  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402
from jaxserve.serve import jaxserve_pb2 as pb  # noqa: E402

READY_TIMEOUT_S = 3600            # an 8B model loads and precompiles its buckets before the ready line
MIN_SHAREGPT_PROMPT_TOKENS = 4
MIN_OUTPUT_TOKENS = 2             # TPOT needs two tokens
OK, HUNG = "OK", "HUNG"           # statuses beside grpc's codes: HUNG = no end within the call's timeout
REJECTED = (grpc.StatusCode.INVALID_ARGUMENT.name, "HTTP_400")   # how each protocol refuses bad input
DEFAULT_MAX_WAITING = 512
INVALID_MAX_TOKENS = 8
KEEP_ALIVE_S = 4.0                # reuse an idle HTTP connection only this long: uvicorn closes them after 5 s
PROTOCOL_COLORS = {"grpc": "tab:blue", "http": "tab:purple"}
CLIENT_START_S = 0.5              # client processes get the point's requests this long before its first is due


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int

    def message(self, cache_salt: str | None = None) -> pb.GenerateRequest:
        return generate_request(self.prompt, SamplingParams(temperature=0.0, max_tokens=self.output_len,
                                                            ignore_eos=True), 0, cache_salt)

    def body(self, cache_salt: str | None = None) -> bytes:
        """The same request for /v1/completions (ignore_eos and cache_salt: vLLM's extra fields)."""
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        return http_body({"prompt": self.prompt, "max_tokens": self.output_len, "temperature": 0.0,
                          "ignore_eos": True, **salt})


def http_body(fields: dict) -> bytes:
    """A streamed completion whose chunks carry their token ids and whose last chunk is the usage."""
    return json.dumps({**fields, "stream": True, "stream_options": {"include_usage": True},
                       "return_token_ids": True}).encode()


@dataclass(slots=True)
class RequestResult:
    status: str = OK                  # a grpc.StatusCode name, HUNG, or the name of another exception
    error: str = ""
    cancelled: bool = False           # the client cancelled it before its last message
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- datasets (grain) ---------------------------------------------------------------------------------
def spread(rng: np.random.Generator, length: int, ratio: float, low: int) -> int:
    return int(rng.integers(max(low, int(length * (1 - ratio))), max(low, int(length * (1 + ratio))) + 1))


def random_dataset(args, vocab: int) -> grain.MapDataset:
    def make(i, rng):
        n = spread(rng, args.input_len, args.range_ratio, 1)
        return BenchRequest(rng.integers(0, vocab, n).tolist(), n,
                            spread(rng, args.output_len, args.range_ratio, MIN_OUTPUT_TOKENS))
    return grain.MapDataset.range(args.num_prompts).seed(args.seed).random_map(make)


def prefix_dataset(args, vocab: int) -> grain.MapDataset:
    prefix = np.random.default_rng(args.seed).integers(0, vocab, args.prefix_len).tolist()

    def make(i, rng):
        suffix = rng.integers(0, vocab, args.input_len).tolist()
        return BenchRequest(prefix + suffix, args.prefix_len + args.input_len, args.output_len)
    return grain.MapDataset.range(args.num_prompts).seed(args.seed + 1).random_map(make)


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    turns = conversation.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human":
        return None
    return turns[0]["value"], turns[1]["value"]


async def sharegpt_requests(args, client: Client, max_model_len: int) -> list[BenchRequest]:
    """Shuffled first exchanges whose prompt and reply fit; token counts come from the server's tokenizer."""
    data = json.loads(pathlib.Path(args.dataset_path).read_text())
    pairs = grain.MapDataset.source(data).shuffle(seed=args.seed).map(first_exchange).filter(lambda p: p is not None)
    out = []
    for prompt, reply in pairs:
        n_in, n_out = len(await client.tokenize(prompt)), len(await client.tokenize(reply))
        if n_in >= MIN_SHAREGPT_PROMPT_TOKENS and n_out >= MIN_OUTPUT_TOKENS and n_in + n_out < max_model_len:
            out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == args.num_prompts:
            return out
    raise ValueError(f"dataset_path: only {len(out)} usable conversations, --num-prompts is {args.num_prompts}")


async def build_requests(args, client: Client) -> list[BenchRequest]:
    info = await client.model_info()
    if args.dataset == "sharegpt":
        if not info.has_tokenizer:
            raise ValueError("dataset: sharegpt needs a model with a tokenizer")
        return await sharegpt_requests(args, client, info.max_model_len)
    make = random_dataset if args.dataset == "random" else prefix_dataset
    requests = list(make(args, info.vocab_size))
    longest = max(r.prompt_len + r.output_len for r in requests)
    if longest >= info.max_model_len:
        raise ValueError(f"input_len/output_len: requests up to {longest} tokens exceed max_model_len="
                         f"{info.max_model_len}")
    return requests


# ---- load ---------------------------------------------------------------------------------------------
class HttpError(Exception):
    """A response whose status is not 200."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status} {message}")
        self.status = status


class StreamError(Exception):
    """An error event inside a started stream, or a usage chunk missing or miscounting the streamed tokens."""


def status_of(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    if isinstance(error, HttpError):
        return f"HTTP_{error.status}"
    return HUNG if isinstance(error, TimeoutError) else type(error).__name__


class HttpClient:
    """Streamed POSTs to <url>/completions over kept-alive HTTP/1.1 connections, one per request in flight. Plain
    asyncio streams rather than httpx2 (the openai client's): on loopback SSE this costs ~28 us of client CPU per
    event to httpx2's ~65, and at saturation the client's one event loop must not be what an HTTP row measures."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.head = (f"POST {parts.path.rstrip('/')}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Content-Type: application/json\r\nContent-Length: ").encode()
        self.idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The last idle connection unless it idled past the server's keep-alive, else a new one."""
        while self.idle:
            since, reader, writer = self.idle.pop()
            if time.monotonic() - since < KEEP_ALIVE_S:
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    async def events(self, body: bytes) -> AsyncIterator[dict]:
        """POST body; its server-sent events up to [DONE]. The connection is kept only after a whole response: one
        left early is closed, which the server takes for a disconnect (an abort)."""
        reader, writer = await self.connection()
        whole = False
        try:
            writer.write(self.head + b"%d\r\n\r\n" % len(body) + body)
            status, headers = await read_head(reader)
            if status != 200:
                message = await reader.readexactly(int(headers.get("content-length", 0)))
                whole = True
                raise HttpError(status, message.decode(errors="replace"))
            async for payload in sse_payloads(reader):
                if payload != b"[DONE]":
                    yield json.loads(payload)
            whole = True
        finally:
            if whole:
                self.idle.append((time.monotonic(), reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status and headers (names lower-cased)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    headers = {}
    while (line := await reader.readline()).strip():
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def sse_payloads(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The `data:` payloads of a chunked text/event-stream body, to its last chunk."""
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        *events, pending = (pending + (await reader.readexactly(size + 2))[:-2]).split(b"\n\n")
        for event in events:
            yield event.removeprefix(b"data: ")
    await reader.readline()   # the empty trailer section


async def grpc_stream(client: Client, message: pb.GenerateRequest) -> AsyncIterator[tuple[int, bool]]:
    """(new tokens, finished) per message of a Generate call; leaving early cancels it."""
    call = client.stub.Generate(message)
    try:
        async for response in call:
            yield sum(len(c.token_ids) for c in response.outputs), response.finished
    finally:
        call.cancel()


async def http_stream(http: HttpClient, body: bytes) -> AsyncIterator[tuple[int, bool]]:
    """(new tokens, finished) per chunk of a streamed completion (one choice); the usage chunk must count the
    tokens the chunks carried."""
    counted, usage = 0, None
    async with contextlib.aclosing(http.events(body)) as events:   # leaving early closes the connection at once
        async for event in events:
            if "error" in event:
                raise StreamError(event["error"]["message"])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                counted += len(choice["token_ids"])
                yield len(choice["token_ids"]), choice["finish_reason"] is not None
    if usage is None or usage["completion_tokens"] != counted:
        raise StreamError(f"usage {usage} does not count the {counted} tokens streamed")


async def read_stream(stream: AsyncIterator[tuple[int, bool]], result: RequestResult, start: float,
                      cancel_after: int) -> None:
    """Time the stream's messages into result; cancel_after > 0: leave it (cancelling the request) after that
    many messages."""
    last, messages = start, 0
    try:
        async with contextlib.aclosing(stream):
            async for new, finished in stream:
                now = time.perf_counter()
                if new and not result.output_tokens:
                    result.ttft = now - start
                elif new:
                    result.itl += [(now - last) / new] * new
                result.output_tokens += new
                last = now if new else last
                messages += 1
                if messages == cancel_after and not finished:
                    result.cancelled = True
                    break
    finally:
        result.e2e = last - start


async def send_stream(stream: AsyncIterator[tuple[int, bool]], limit: asyncio.Semaphore, cancel_after: int = 0,
                      timeout: float | None = None) -> RequestResult:
    """One request's stream, started under `limit`; one that fails, or does not end within timeout s (HUNG), is
    counted, not fatal (e2e is then the time to the failure)."""
    async with limit:
        start, result = time.perf_counter(), RequestResult()
        try:
            async with asyncio.timeout(timeout):
                await read_stream(stream, result, start, cancel_after)
        except Exception as e:
            result = RequestResult(status=status_of(e), error=f"{type(e).__name__}: {e}",
                                   e2e=time.perf_counter() - start)
        return result


async def send(client: Client, message: pb.GenerateRequest, limit: asyncio.Semaphore, cancel_after: int = 0,
               timeout: float | None = None) -> RequestResult:
    """One Generate call under `limit` (send_stream over gRPC)."""
    return await send_stream(grpc_stream(client, message), limit, cancel_after, timeout)


@dataclass(frozen=True, slots=True)
class Transport:
    """One protocol's way to send the benchmark's requests: a request's payload (with its cache salt), an invalid
    request's (sampling options, prompt ids), and a payload's stream of (new tokens, finished)."""
    name: str
    request: Callable[[BenchRequest, str | None], object]
    invalid: Callable[[dict, list[int]], object]
    stream: Callable[[object], AsyncIterator[tuple[int, bool]]]
    ready: dict[str, str]   # the server's endpoints, for client processes to connect to


def grpc_transport(client: Client, ready: dict[str, str]) -> Transport:
    def invalid(options: dict, ids: list[int]) -> pb.GenerateRequest:
        sampling = pb.SamplingOptions(**{"max_tokens": INVALID_MAX_TOKENS, **options})
        return pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
    return Transport("grpc", BenchRequest.message, invalid, functools.partial(grpc_stream, client), ready)


def http_transport(http: HttpClient, ready: dict[str, str]) -> Transport:
    invalid = lambda options, ids: http_body({"prompt": ids, "max_tokens": INVALID_MAX_TOKENS, **options})  # noqa: E731
    return Transport("http", BenchRequest.body, invalid, functools.partial(http_stream, http), ready)


def arrival_offsets(count: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the point's start at which each request is sent: Poisson arrivals at `rate`; inf: all at once."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, count) if math.isfinite(rate) else np.zeros(count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


async def run_share(stream: Callable[[object], AsyncIterator], messages: list, offsets: np.ndarray,
                    concurrency: int, start: float) -> tuple[list[RequestResult], float, float]:
    """Send messages at start + offsets (time.monotonic), at most `concurrency` in flight; the results, the time
    the last ended and the CPU seconds this process spent meanwhile."""
    limit, tasks, cpu = asyncio.Semaphore(concurrency), [], time.process_time()
    for message, offset in zip(messages, offsets):
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        tasks.append(asyncio.create_task(send_stream(stream(message), limit)))
    results = await asyncio.gather(*tasks)
    return results, time.monotonic(), time.process_time() - cpu


def run_share_process(protocol: str, ready: dict[str, str], messages: list, offsets: np.ndarray,
                      concurrency: int, start: float) -> tuple[list[RequestResult], float, float]:
    """run_share in a client process of its own, over its own connections."""
    async def run():
        if protocol == "grpc":
            async with Client(ready["grpc"]) as client:
                return await run_share(functools.partial(grpc_stream, client), messages, offsets, concurrency, start)
        http = HttpClient(ready["http"])
        try:
            return await run_share(functools.partial(http_stream, http), messages, offsets, concurrency, start)
        finally:
            await http.aclose()
    return asyncio.run(run())


@dataclass(slots=True)
class PointRun:
    wall: float
    results: list[RequestResult]
    client_cpu_pct: float   # the busiest client process's CPU time over the wall time: near 100 = client-bound


async def run_point(transport: Transport, messages: list, rate: float, concurrency: int, seed: int,
                    pool: ProcessPoolExecutor | None, processes: int) -> PointRun:
    """Every request sent; with a pool, request i goes through client process i mod P (its arrival time and a
    1/P share of the concurrency kept), so that no single client process's per-message cost caps the point."""
    offsets, processes = arrival_offsets(len(messages), rate, seed), min(processes, concurrency, len(messages))
    if processes == 1:
        start = time.monotonic()
        results, end, cpu = await run_share(transport.stream, messages, offsets, concurrency, start)
        return PointRun(end - start, results, 100 * cpu / (end - start))
    start, loop = time.monotonic() + CLIENT_START_S, asyncio.get_running_loop()
    shares = await asyncio.gather(*[loop.run_in_executor(
        pool, run_share_process, transport.name, transport.ready, messages[i::processes], offsets[i::processes],
        concurrency // processes + (i < concurrency % processes), start) for i in range(processes)])
    results = [None] * len(messages)
    for i, (share, _, _) in enumerate(shares):
        results[i::processes] = share
    return PointRun(max(end for _, end, _ in shares) - start, results,
                    max(100 * cpu / (end - start) for _, end, cpu in shares))


def invalid_kinds(count: int, info: pb.ModelInfoResponse) -> list[tuple[dict, list[int]]]:
    """`count` (sampling options, prompt ids) a bad client sends, cycling through the kinds of mistake."""
    ids = [1] * 8
    kinds = (({"top_p": 1.5}, ids), ({"max_tokens": 0}, ids), ({"temperature": -1.0}, ids), ({"n": 0}, ids),
             ({}, [info.vocab_size] * 8), ({}, [-1] * 8), ({}, []), ({}, [1] * (info.max_model_len + 1)))
    return list(itertools.islice(itertools.cycle(kinds), count))


def even_spots(n: int) -> np.ndarray:
    return (np.arange(n) + 0.5) / max(n, 1)


def interleave(valid: list, invalid: list) -> tuple[list, np.ndarray]:
    """Both lists spread evenly over one, each in its order; and where the invalid ones went (a mask)."""
    order = np.argsort(np.concatenate([even_spots(len(valid)), even_spots(len(invalid))]), kind="stable")
    return [(valid + invalid)[i] for i in order], order >= len(valid)


def percentiles(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s) * 1e3 if values_s else np.full(1, np.nan)
    return {f"{name}_mean_ms": float(ms.mean()), f"{name}_p50_ms": float(np.median(ms)),
            f"{name}_p99_ms": float(np.quantile(ms, 0.99))}


def summarize(params: dict, wall: float, results: list[RequestResult], requests: list[BenchRequest],
              before, after) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(q.prompt_len for q, r in zip(requests, results) if r.ok)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return {"bench": "serve", "impl": "jaxserve", "params": params, "ms": wall * 1e3, "tok_s": out_tokens / wall,
            "req_s": len(ok) / wall, "total_tok_s": (in_tokens + out_tokens) / wall, "completed": len(ok),
            "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
            "wrong_length": sum(r.output_tokens != q.output_len for q, r in zip(requests, results) if r.ok),
            "output_tokens": out_tokens, "prompt_tokens": in_tokens,
            **percentiles("ttft", [r.ttft for r in ok]),
            **percentiles("tpot", [r.tpot for r in ok if r.output_tokens > 1]),
            **percentiles("itl", [x for r in ok for x in r.itl]), **percentiles("e2e", [r.e2e for r in ok]),
            "prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
            "preemptions": after.preemptions - before.preemptions, "engine_steps": (steps := after.engine_steps
                                                                                  - before.engine_steps),
            "step_ms": wall * 1e3 / steps if steps else math.nan}


def invalid_summary(results: list[RequestResult]) -> dict:
    """The invalid requests' ends: INVALID_ARGUMENT (as they must), any other status, and how fast."""
    statuses = Counter(r.status for r in results)
    rejected = sum(statuses.pop(status, 0) for status in REJECTED)
    return {"invalid_requests": len(results), "invalid_rejected": rejected, "invalid_errors": dict(statuses),
            **percentiles("reject", [r.e2e for r in results if r.status in REJECTED])}


def cache_salt(invalid_frac: float, protocol: str) -> str | None:
    """The valid requests' prefix-cache namespace at this invalid fraction through this protocol: points reuse the
    prompts, so each (fraction, protocol) meets the cache as gRPC at F = 0 does."""
    return "-".join(([] if protocol == "grpc" else [protocol]) +
                    ([f"invalid-frac-{invalid_frac:g}"] if invalid_frac else [])) or None


def point_params(args, num_prompts: int, rate: float, concurrency: int, invalid_frac: float, model: str,
                 protocol: str) -> dict:
    return {"dataset": args.dataset, "num_prompts": num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "prefix_len": args.prefix_len if args.dataset == "prefix" else 0,
            "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": concurrency, "model": model,
            "protocol": protocol, "client_processes": args.client_processes,
            **({"invalid_frac": invalid_frac} if invalid_frac else {}),
            **({"server_args": args.server_args} if args.server_args and not args.target else {})}


async def measure_point(transport: Transport, client: Client, args, requests: list[BenchRequest],
                        info: pb.ModelInfoResponse, point: tuple[float, int, float], model: str,
                        pool: ProcessPoolExecutor | None, server_pid: int | None) -> dict:
    """One row: the valid requests with round(n * f / (1 - f)) invalid ones among them (f of all requests)."""
    rate, concurrency, invalid_frac = point
    invalid = [transport.invalid(*kind) for kind in
               invalid_kinds(round(len(requests) * invalid_frac / (1 - invalid_frac)), info)]
    salt = cache_salt(invalid_frac, transport.name)
    messages, is_invalid = interleave([transport.request(r, salt) for r in requests], invalid)
    before, threads_before = await client.server_stats(), thread_cpu_s(server_pid)
    run = await run_point(transport, messages, rate, concurrency, args.seed, pool, args.client_processes)
    row = summarize(point_params(args, len(requests), *point, model, transport.name), run.wall,
                    [r for r, bad in zip(run.results, is_invalid) if not bad], requests, before,
                    await client.server_stats())
    row |= {"client_cpu_pct": run.client_cpu_pct,
            **({"server_cpu_pct": server_cpu_pct(threads_before, thread_cpu_s(server_pid), run.wall)}
               if server_pid else {})}
    return row | (invalid_summary([r for r, bad in zip(run.results, is_invalid) if bad]) if invalid_frac else {})


def thread_cpu_s(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process pid and of its children (the engine process), by
    "<name>:<tid>" ("main" for a process's first thread; a child's prefixed "engine/"); {} without a pid."""
    if pid is None:
        return {}
    seconds = {}
    for proc, prefix in [(pid, ""), *((child, "engine/") for child in child_pids(pid))]:
        for task in pathlib.Path(f"/proc/{proc}/task").iterdir():
            with contextlib.suppress(OSError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                name = "main" if task.name == str(proc) else (task / "comm").read_text().strip()
                seconds[f"{prefix}{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children


def server_cpu_pct(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """The server's busiest threads over a point: CPU percent of the wall time, the five busiest, by thread."""
    pct = {name: 100 * (s - before.get(name, 0.0)) / wall for name, s in after.items()}
    return dict(sorted(pct.items(), key=lambda kv: -kv[1])[:5])


async def warm_up(transport: Transport, args, requests: list[BenchRequest], salt: str | None,
                  pool: ProcessPoolExecutor | None) -> None:
    """First transfers and connections, the allocator, any bucket the server compiles lazily; and the cache
    namespace, as a point leaves it for the next. Run just before the namespace's first point, so that no other
    pass comes between to evict it (passes of other namespaces would, unevenly)."""
    await run_point(transport, [transport.request(r, salt) for r in requests[:args.warmup_prompts]],
                    math.inf, max(args.max_concurrency), args.seed, pool, args.client_processes)


async def sweep(args, ready: dict[str, str], server_pid: int | None) -> tuple[list[dict], str]:
    """Every point, once per protocol back to back; the rows and the server's device."""
    async with Client(ready["grpc"]) as client, contextlib.AsyncExitStack() as stack:
        http = HttpClient(ready["http"]) if "http" in args.protocol else None
        if http:
            stack.push_async_callback(http.aclose)
        pool = stack.enter_context(ProcessPoolExecutor(args.client_processes, multiprocessing.get_context("spawn"))) \
            if args.client_processes > 1 else None   # spawn: a forked child would share this process's gRPC state
        transports = [grpc_transport(client, ready) if name == "grpc" else http_transport(http, ready)
                      for name in args.protocol]
        requests = await build_requests(args, client)
        info = await client.model_info()
        model = pathlib.Path(args.config).stem if args.config else info.model
        rows, warmed = [], set()
        for point in itertools.product(args.request_rate, args.max_concurrency, args.invalid_frac):
            for transport in transports:
                if (salt := cache_salt(point[2], transport.name)) not in warmed:
                    warmed.add(salt)
                    await warm_up(transport, args, requests, salt, pool)
                rows.append(await measure_point(transport, client, args, requests, info, point, model, pool,
                                                server_pid))
            compare_protocols(rows[-len(transports):])
            for row in rows[-len(transports):]:
                print_row(row)
        return rows, info.device


def compare_protocols(rows: list[dict]) -> None:
    """The HTTP row of a point gets vs_grpc_pct: how much higher than gRPC's each figure is, in percent."""
    by = {r["params"]["protocol"]: r for r in rows}
    if {"grpc", "http"} <= by.keys():
        grpc_row, http_row = by["grpc"], by["http"]
        http_row["vs_grpc_pct"] = {k: 100 * (http_row[k] / grpc_row[k] - 1) if grpc_row[k] else math.nan
                                   for k in ("tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms")}


def print_row(row: dict) -> None:
    p = row["params"]
    invalid = (f" | invalid {p['invalid_frac']:g}: {row['invalid_rejected']}/{row['invalid_requests']} rejected, "
               f"p99 {row['reject_p99_ms']:.1f} ms, other ends {row['invalid_errors']}" if "invalid_frac" in p else "")
    wrong = f" | WRONG LENGTH {row['wrong_length']}" if row["wrong_length"] else ""
    vs = row.get("vs_grpc_pct")
    vs = (f" | vs grpc: tok/s {vs['tok_s']:+.1f}% TTFT {vs['ttft_p50_ms']:+.1f}% TPOT {vs['tpot_p50_ms']:+.1f}% "
          f"ITL {vs['itl_p50_ms']:+.1f}%" if vs else "")
    print(f"{p['protocol']:>4} rate {p['request_rate']:>4} conc {p['max_concurrency']:>4}: {row['tok_s']:8.1f} out "
          f"tok/s {row['req_s']:6.2f} req/s | TTFT p50 {row['ttft_p50_ms']:8.1f} p99 {row['ttft_p99_ms']:8.1f} ms | "
          f"TPOT p50 {row['tpot_p50_ms']:7.1f} p99 {row['tpot_p99_ms']:7.1f} ms | ITL p50 {row['itl_p50_ms']:7.1f} "
          f"p99 {row['itl_p99_ms']:7.1f} ms | failed {row['failed']}{wrong}{invalid}{vs}", flush=True)
    server = " ".join(f"{name} {pct:.0f}%" for name, pct in row.get("server_cpu_pct", {}).items())
    print(f"     {row['engine_steps']} engine steps, {row['step_ms']:.1f} ms each | client CPU {row['client_cpu_pct']:.0f}% "
          f"(busiest of {row['params']['client_processes']} processes)"
          + (f" | server threads: {server}" if server else ""), flush=True)


# ---- the server ---------------------------------------------------------------------------------------
def start_server(args, log: pathlib.Path, max_waiting: int) -> tuple[subprocess.Popen, dict[str, str]]:
    """The server and its ready line's endpoints: {"grpc": host:port, "http": its /v1 URL}."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--grpc-port", "0", "--no-metrics",
           "--max-waiting", str(max_waiting), *shlex.split(args.server_args)]
    cmd += ["--config", args.config] if args.config else []
    cmd += ["--model", args.model] if args.model else []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=SERVER_ENV)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (match := re.search(r"ready (grpc=.*)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"jaxserve serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, dict(part.split("=", 1) for part in match.group(1).split())


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def endpoints(args, max_waiting: int, http: bool = False) -> Iterator[tuple[dict[str, str], subprocess.Popen | None]]:
    """({"grpc": --target, "http": --http-target}, None) for --target; else a server started for the block (its
    output in --server-log or a temporary file) and stopped after it, with its process."""
    if args.target:
        yield {"grpc": args.target, **({"http": args.http_target} if http else {})}, None
        return
    with tempfile.TemporaryDirectory() as tmp:
        proc, ready = start_server(args, pathlib.Path(args.server_log or pathlib.Path(tmp) / "server.log"),
                                   max_waiting)
        try:
            yield ready, proc
        finally:
            stop_server(proc)


@contextlib.contextmanager
def serving(args, max_waiting: int) -> Iterator[tuple[str, subprocess.Popen | None]]:
    """endpoints() over gRPC alone: (its address, the process or None)."""
    with endpoints(args, max_waiting) as (ready, proc):
        yield ready["grpc"], proc


# ---- results ------------------------------------------------------------------------------------------
def point_label(p: dict) -> str:
    invalid = f"\ninvalid {p['invalid_frac']:g}" if "invalid_frac" in p else ""
    return f"{p['protocol']}\nrate {p['request_rate']}\nconc {p['max_concurrency']}{invalid}"


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [point_label(r["params"]) for r in rows]
    x = np.arange(len(rows))
    fig, (ax_tok, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_tok.bar(x, [r["tok_s"] for r in rows], color=[PROTOCOL_COLORS[r["params"]["protocol"]] for r in rows])
    ax_tok.set(title="output throughput", ylabel="tok/s", xticks=x, xticklabels=labels)
    for i, (metric, color) in enumerate((("ttft", "tab:orange"), ("tpot", "tab:green"), ("itl", "tab:red"))):
        for q, alpha in (("p50", 1.0), ("p99", 0.45)):
            ax_lat.bar(x + (i - 1) * 0.27, [r[f"{metric}_{q}_ms"] for r in rows], 0.25, color=color, alpha=alpha,
                       label=f"{metric.upper()} {q}", zorder=3 if q == "p50" else 2)
    ax_lat.set(title="latency (p50 solid, p99 light)", ylabel="ms", xticks=x, xticklabels=labels, yscale="log")
    ax_lat.legend(fontsize=8, ncol=3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="host:port of a running server (default: start one)")
    p.add_argument("--config", default=None, help="YAML run config for the server it starts")
    p.add_argument("--model", default=None, help="model for the server it starts")
    p.add_argument("--server-args", default="", help="extra `jaxserve serve` flags, one string")
    p.add_argument("--server-log", default=None, help="keep the started server's output here")


def add_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--dataset", choices=["random", "prefix", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.25, help="random: lengths uniform in len * (1 -/+ r)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], help="requests/s; inf: all at once")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--invalid-frac", type=float, nargs="+", default=[0.0],
                   help="share of all requests that are invalid, interleaved with the valid ones; 0: none")
    p.add_argument("--protocol", choices=["grpc", "http"], nargs="+", default=["grpc"],
                   help="each point runs once per protocol, against the same server")
    p.add_argument("--http-target", default=None,
                   help="with --target and --protocol http: the running server's OpenAI API, http://host:port/v1")
    p.add_argument("--client-processes", type=int, default=1,
                   help="client processes sharing each point's requests (each with its own connections)")
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/serve_<backend>.json)")


def check_args(args) -> None:
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise ValueError("dataset_path: --dataset sharegpt needs --dataset-path")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1")
    if args.client_processes < 1:
        raise ValueError("client_processes must be >= 1")
    if min(args.max_concurrency) < 1 or min(args.request_rate) <= 0:
        raise ValueError("max_concurrency must be >= 1 and request_rate > 0")
    if not all(0 <= f < 1 for f in args.invalid_frac):
        raise ValueError("invalid_frac must be in [0, 1)")
    args.protocol = list(dict.fromkeys(args.protocol))
    if args.target and "http" in args.protocol and not args.http_target:
        raise ValueError("http_target: --target with --protocol http needs --http-target")


def cmd_serve_load(args, command: str) -> None:
    check_args(args)
    with endpoints(args, max(DEFAULT_MAX_WAITING, args.num_prompts), "http" in args.protocol) as (ready, proc):
        rows, device = asyncio.run(sweep(args, ready, proc.pid if proc else None))
    # Only now touch this process's device: on a GPU machine the server had it to itself.
    out = pathlib.Path(args.out or ROOT / f"benchmarks/results/serve_{jax.default_backend()}.json")
    write_rows(out, rows, command)
    p = rows[0]["params"]
    plot(rows, out.with_suffix(".png"), f"jaxserve serve ({' vs '.join(args.protocol)}): {p['model']} on {device}, "
         f"{p['dataset']} prompts, {p['num_prompts']} requests x {p['input_len']} in / {p['output_len']} out (greedy)")


def run_main(script: str, doc: str, add_script_args, run, argv=None) -> None:
    """Parse argv and call run(args, command line); a ValueError exits with `<script>: error: ...`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_script_args(ap)
    args = ap.parse_args(argv)
    command = f"python benchmarks/{script}.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        run(args, command)
    except ValueError as e:
        sys.exit(f"{script}: error: {e}")


def main(argv=None) -> None:
    run_main("serve_load", __doc__, add_args, cmd_serve_load, argv)


if __name__ == "__main__":
    main()
