"""The HTTP front end's connection hygiene and access rules (jaxserve/serve/connections.py, openai_http.py): one
in-process server over a tiny random model (no tokenizer: token-id prompts) with an API key, one allowed browser
origin and short limits; raw sockets play the slow, silent or greedy clients. A subprocess with a low descriptor
limit shows what happens when the process runs out of them."""
import json
import logging
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx2
import jax.numpy as jnp
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.models.loader import random_model
from jaxserve.serve.connections import ConnectionLimits
from jaxserve.serve.server import ServeOptions

from helpers import SERVER_KNOBS, TINY_NO_EOS, base_url, in_process, wait_idle

REPO = Path(__file__).resolve().parents[1]
KEY, ORIGIN = "k3y", "https://ok.example"
LIMITS = ConnectionLimits(max_connections=8, read_timeout_s=1.0, write_timeout_s=1.0)
AUTH = {"Authorization": f"Bearer {KEY}"}
IDS = list(range(3, 40))
CUT_WITHIN_S = 10   # a connection past a 1 s limit must be gone well before this
STEP_S = 0.02


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(random_model(TINY_NO_EOS, jnp.float32), EngineConfig(precompile=False, **SERVER_KNOBS))
    with in_process(engine, api_key=KEY, allowed_origins=(ORIGIN,), http_limits=LIMITS) as s:
        yield s


def post(server, body: bytes | dict, headers: dict | None = None) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    return httpx2.post(base_url(server) + "/v1/completions", content=content, headers=headers, timeout=60)


@pytest.mark.slow
def test_the_lone_surrogate_salt_is_refused_at_the_edge_and_the_engine_keeps_serving(server):
    """The hole: a `\\ud800` cache_salt passed validation and raised on the engine thread, ending the server;
    sent as text/plain, any web page could send it."""
    body = b'{"prompt": [3, 4, 5], "max_tokens": 4, "cache_salt": "\\ud800"}'
    plain, as_json = post(server, body, {"Content-Type": "text/plain"}), post(server, body)
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    assert as_json.status_code == 400 and as_json.json()["error"]["param"] == "cache_salt"
    for field, value in (("stop_token_ids", [1]), ("stop", "\udfff"), ("\ud800", 1), ("prompt", "x\ud83d")):
        response = post(server, json.dumps({"prompt": IDS, "max_tokens": 2, field: value}).encode())
        assert response.status_code == 200 if field == "stop_token_ids" else response.status_code == 400
    assert post(server, {"prompt": IDS, "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3
    assert server.engine_loop.stats()["serving"]


@pytest.mark.parametrize("body, param", [
    (b"[" * 50_000 + b"]" * 50_000, None), (b'{"prompt": [3], "temperature": 1e308}', "temperature"),
    (b'{"prompt": [3], "repetition_penalty": 1e-300}', "repetition_penalty"),
    (b'{"prompt": [3], "repetition_penalty": 1e300}', "repetition_penalty"),
    (json.dumps({"prompt": [3] * 600_000}).encode(), "prompt")], ids=["deep", "temperature", "rp-tiny", "rp-huge",
                                                                      "id-flood"])
@pytest.mark.slow
def test_unbounded_inputs_are_400s_naming_the_field(server, body, param):
    response = post(server, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert server.engine_loop.stats()["serving"]


@pytest.mark.slow
def test_browser_origins_are_refused_unless_allowed_with_cors(server):
    url, body = base_url(server) + "/v1/completions", {"prompt": IDS, "max_tokens": 2}
    evil = post(server, body, {"Origin": "http://evil.example"})
    ok = post(server, body, {"Origin": ORIGIN})
    preflight = {origin: httpx2.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "authorization,content-type"},
                                        timeout=10) for origin in (ORIGIN, "http://evil.example")}
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert preflight[ORIGIN].status_code == 200 and "POST" in preflight[ORIGIN].headers["access-control-allow-methods"]
    assert preflight["http://evil.example"].status_code == 403


@pytest.mark.slow
def test_the_bearer_scheme_is_case_insensitive_and_health_stays_open(server):
    url = base_url(server)
    assert [httpx2.get(url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10).status_code
            for scheme in ("bearer", "BEARER", "Basic")] == [200, 200, 401]
    assert httpx2.get(url + "/metrics", timeout=10).status_code == 401
    assert httpx2.get(url + "/health", timeout=10).status_code == 200


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:   # before connect: it sizes the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(CUT_WITHIN_S)
    sock.connect(("127.0.0.1", server.http_port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes | None:
    """What the server sent until it ended the connection; None if it did not within CUT_WITHIN_S."""
    data = []
    try:
        while chunk := sock.recv(65536):
            data.append(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return b"".join(data)


def request_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


@pytest.mark.slow
def test_slow_headers_and_slow_bodies_are_cut_after_the_read_timeout(server):
    with connect(server) as silent, connect(server) as trickling_headers, connect(server) as trickling_body:
        trickling_headers.sendall(request_head(100)[:30])
        trickling_body.sendall(request_head(100) + b'{"prompt": ')
        start = time.monotonic()
        assert read_until_closed(silent) == read_until_closed(trickling_headers) == b""
        reply = read_until_closed(trickling_body)
        assert time.monotonic() - start < CUT_WITHIN_S
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


def read_response(sock: socket.socket) -> bytes:
    """One whole response to a request without a body (its headers, then content-length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head


@pytest.mark.slow
def test_an_idle_kept_alive_connection_lasts_the_read_timeout_longer_than_clients_pools_keep_it(server):
    """A server closing an idle connection first races the client that reuses it: its request meets a reset
    (uvicorn's default 5 s is httpx's pool expiry, so the openai client hit it). Idle connections last the read
    timeout, whose default outlasts httpx's pools."""
    assert ConnectionLimits().read_timeout_s > 3 * httpx2.Limits().keepalive_expiry
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(health)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(LIMITS.read_timeout_s / 2)
        sock.sendall(health)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        idle_since = time.monotonic()
        assert read_until_closed(sock) == b""
        assert LIMITS.read_timeout_s * 0.9 < time.monotonic() - idle_since < LIMITS.read_timeout_s + 1.5


@pytest.mark.slow
def test_a_client_that_disconnects_mid_body_logs_no_traceback(server):
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        with connect(server) as sock:
            sock.sendall(request_head(1000) + b'{"prompt": [1, 2')
        time.sleep(0.5)
        assert post(server, {"prompt": IDS, "max_tokens": 1}).status_code == 200
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert records == []


@pytest.mark.slow
def test_connections_past_the_cap_get_503_and_the_server_recovers(server):
    idle = [connect(server) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)   # accepted
        with connect(server) as extra:
            reply = read_until_closed(extra)
    finally:
        for sock in idle:
            sock.close()
    assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
    time.sleep(0.2)
    assert post(server, {"prompt": IDS, "max_tokens": 1}).status_code == 200


@pytest.mark.slow
def test_a_stream_whose_client_stops_reading_is_cut_and_its_request_aborted(server, monkeypatch):
    """The client reads nothing: once the server's buffers fill, the write timeout cuts the connection, which
    aborts the request and frees its blocks long before it would have finished (steps slowed to STEP_S, as a
    real model's are: the tiny one would finish first)."""
    engine = server.engine_loop.replicas[0].engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(STEP_S) or step())
    before = wait_idle(server)
    body = json.dumps({"prompt": IDS, "max_tokens": 400, "n": 8, "logprobs": 20, "ignore_eos": True,
                       "stream": True, "return_token_ids": True}).encode()
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(request_head(len(body)) + body)
        deadline = time.monotonic() + 60
        while server.engine_loop.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = wait_idle(server)
        assert read_until_closed(sock) is not None
    assert (after["running"], after["waiting"], after["pending"], after["kv_blocks_used"]) == (0, 0, 0, 0)
    assert 0 < after["engine_steps"] - before["engine_steps"] < 400 - 10   # aborted, not run out


def test_check_bindable_takes_a_port_in_time_wait():
    """A drained server's closed connections leave its port in TIME-WAIT: the pre-check must bind it as the
    servers do (SO_REUSEADDR), or a supervisor's immediate restart fails for a minute."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()   # the server side closes first: its end enters TIME-WAIT
        client.recv(1)
        client.close()
    ServeOptions(grpc_port=port, http_port=0).check_bindable()


FD_SCRIPT = textwrap.dedent("""
    import asyncio, resource, sys
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route
    from jaxserve.serve.connections import ConnectionLimits, raise_fd_limit
    from jaxserve.serve.openai_http import HttpServer

    async def main():
        app = Starlette(routes=[Route("/health", lambda request: Response(status_code=200))])
        server = HttpServer(app, "127.0.0.1", 0, 1.0, ConnectionLimits(max_connections=10_000, read_timeout_s=2.0))
        print(raise_fd_limit(), await server.start(), flush=True)
        await asyncio.sleep(3600)

    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 64))
    asyncio.run(main())
""")


@pytest.mark.slow
def test_out_of_descriptors_is_one_warning_and_service_resumes(tmp_path):
    """19,990 idle sockets used to exhaust the descriptors and asyncio logged a traceback per accept retry: now
    the soft limit is raised to the hard one, the failure is one rate-limited line, idle sockets are cut after the
    read timeout and the server answers again."""
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", FD_SCRIPT], stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=REPO)
    try:
        limit, port = map(int, proc.stdout.readline().split())
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(120)]   # the rest wait in the backlog
        time.sleep(3)
        for sock in socks:
            sock.close()
        deadline, status = time.monotonic() + 30, None
        while status != 200 and time.monotonic() < deadline:
            try:
                status = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
            except httpx2.TransportError:
                time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert limit == 64 and status == 200
    assert "out of file descriptors" in text and "Traceback" not in text and len(text.splitlines()) <= 3, text
