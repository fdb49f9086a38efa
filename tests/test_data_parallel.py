"""Data-parallel replicas behind one server. The serving checks need two devices, so they run in a child process
(this file as a script, the CPU split into 2 devices before JAX starts; see tests/tp_worker.py): an in-process
server over two engines of the tiny random model, one per device, driven over gRPC and HTTP. It prints one JSON
object of what it saw. The refusals of too few devices run here, on this process's one device.

  python tests/test_data_parallel.py   # the child
"""
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import jax
import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import KNOBS, token_prompts  # noqa: E402
from multihost_worker import TINY_HF  # noqa: E402

from jaxserve import LLM, LLMEngine, SamplingParams  # noqa: E402
from jaxserve.client import Client  # noqa: E402
from jaxserve.models.loader import load_replicas  # noqa: E402
from jaxserve.sharding import replica_meshes  # noqa: E402
from jaxserve.serve.server import ServeOptions, Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
ENGINE = {**KNOBS, "token_buckets": list(KNOBS["token_buckets"]), "seq_buckets": list(KNOBS["seq_buckets"]),
          "num_blocks": 80, "max_model_len": 512}
PROMPTS = token_prompts(5, 17, 33, 9, 40, 12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# outlives its part of the test, a lazy compile on the other replica included
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


# ---- the child: two replicas on two CPU devices -------------------------------------------------------------
class Recorder:
    """Which replica each request was added to and aborted on (wrapping the engines' own methods)."""

    def __init__(self, engines: list[LLMEngine]):
        self.added, self.aborted = {}, []
        for index, engine in enumerate(engines):
            self.wrap(index, engine)

    def wrap(self, index: int, engine: LLMEngine) -> None:
        add, abort = engine.add_request, engine.abort

        def add_request(prompt, params=None, *, request_id=None, **kw):
            self.added[request_id] = index
            return add(prompt, params, request_id=request_id, **kw)

        def aborted(request_id):
            live = abort(request_id)
            self.aborted.append((index, request_id, live))
            return live
        engine.add_request, engine.abort = add_request, aborted


def fail_step(engine: LLMEngine) -> None:
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("injected device failure"))


async def opened(client: Client, prompt, params):
    """A stream that has produced its first message."""
    stream = client.generate(prompt, params)
    await anext(stream)
    return stream


async def grpc_error(call) -> str:
    try:
        await asyncio.wait_for(call, 30)
    except Exception as e:   # grpc.aio.AioRpcError
        return f"{e.code().name}: {e.details()}"
    return "no error"


def http(url: str, body: dict | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, json.dumps(body).encode() if body else None,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def wait_idle(server: Server) -> dict:
    for _ in range(600):
        stats = server.engine_loop.stats()
        if not (stats["running"] or stats["waiting"] or stats["pending"] or stats["kv_blocks_used"]):
            break
        await asyncio.sleep(0.05)
    return stats


async def scenario(engines: list[LLMEngine], recorder: Recorder) -> dict:
    server = Server(engines, ServeOptions(grpc_port=0, http_port=0, grace_period_s=1.0), ("tiny",))
    await server.start()
    base = f"http://127.0.0.1:{server.http_port}"
    try:
        async with Client(f"127.0.0.1:{server.grpc_port}") as c:
            out = await served_by_both(c, base, recorder)
            out["stats"] = await wait_idle(server)
            out["aborted"] = list(recorder.aborted)   # the aborts ran before the engines went idle
            out["grpc_stats"] = {k: getattr(await c.server_stats(), k) for k in ("kv_blocks_total", "engine_steps",
                                                                                 "compiles_after_start", "serving")}
            out["engine_stats"] = [e.stats() for e in engines]
            out["replica_steps"] = [r.steps for r in server.engine_loop.replicas]
            out["metrics"] = server.metrics.exposition()[0].decode()
            out["one_failed"] = await one_replica_fails(c, server, engines, base)
            out["both_failed"] = await both_replicas_fail(c, server, engines, base)
    finally:
        await server.stop()
    return out


async def served_by_both(c: Client, base: str, recorder: Recorder) -> dict:
    """Requests 0-5 over gRPC and 6 over HTTP, all in flight at once; then, the graphs compiled, two long streams
    7 and 8 opened together (the second finds replica 0 busy) and cancelled at their first message."""
    calls = [c.complete(p, GREEDY) for p in PROMPTS]
    post = asyncio.to_thread(http, f"{base}/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8,
                                                              "temperature": 0, "return_token_ids": True})
    *replies, (_, body) = await asyncio.gather(*calls, post)
    out = {"grpc_tokens": [list(r.outputs[0].token_ids) for r in replies],
           "http_tokens": body["choices"][0]["token_ids"],
           "batch_replicas": [recorder.added[str(i)] for i in range(len(PROMPTS) + 1)]}
    first = await opened(c, [5, 6, 7], LONG)
    second = c.generate([8, 9, 10], LONG)
    second_opened = asyncio.create_task(anext(second))
    while "8" not in recorder.added:   # routed while the first is open; the first cancelled while it runs
        await asyncio.sleep(0.001)
    await first.aclose()   # cancels the call: the abort must reach the replica serving it
    await second_opened
    await second.aclose()
    return {**out, "long_replicas": [recorder.added["7"], recorder.added["8"]]}


async def one_replica_fails(c: Client, server: Server, engines: list[LLMEngine], base: str) -> dict:
    """Replica 1 fails on the request routed to it (replica 0 holds a stream); then replica 0 serves the rest."""
    fail_step(engines[1])
    held = await opened(c, [11, 12, 13], LONG)
    error = await grpc_error(c.complete(PROMPTS[1], GREEDY))
    after = await asyncio.wait_for(c.complete(PROMPTS[2], GREEDY), 30)
    await held.aclose()
    status, _ = await asyncio.to_thread(http, f"{base}/health")
    return {"error": error, "health": await c.health(), "http_health": status, "stats": server.engine_loop.stats(),
            "failed": server.failed.is_set(), "after_tokens": list(after.outputs[0].token_ids)}


async def both_replicas_fail(c: Client, server: Server, engines: list[LLMEngine], base: str) -> dict:
    fail_step(engines[0])
    error = await grpc_error(c.complete(PROMPTS[3], GREEDY))
    await asyncio.wait_for(server.failed.wait(), 30)
    status, _ = await asyncio.to_thread(http, f"{base}/health")
    return {"error": error, "health": await c.health(), "http_health": status, "stats": server.engine_loop.stats(),
            "refused": await grpc_error(c.complete(PROMPTS[4], GREEDY))}


def child() -> dict:
    jax.config.update("jax_num_cpu_devices", 2)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tiny.yaml"
        config.write_text(yaml.safe_dump({"model": "random", "dtype": "f32", "random_model": TINY_HF,
                                          "engine": {**ENGINE, "precompile": False}}))
        replicas, cfg = load_replicas(config=str(config), data_parallel_size=2)
    devices = [[d.id for d in r.mesh.devices.flat] for r in replicas]
    reference = LLM(replicas[0], config=cfg).generate(PROMPTS, GREEDY, use_tqdm=False)
    engines = [LLMEngine(r, cfg) for r in replicas]
    fingerprints = [e.graphs.manager.cache.fingerprint for e in engines]
    out = asyncio.run(scenario(engines, Recorder(engines)))
    return {**out, "devices": devices, "reference": [o.outputs[0].token_ids for o in reference],
            "same_fingerprint": fingerprints[0] == fingerprints[1]}


# ---- the tests -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp2() -> dict:
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_each_replica_has_its_own_device_and_executables(dp2):
    assert dp2["devices"] == [[0], [1]] and not dp2["same_fingerprint"]


@pytest.mark.slow
def test_requests_go_to_the_least_loaded_replica_and_match_one_engine(dp2):
    assert set(dp2["batch_replicas"]) == {0, 1}   # gRPC and HTTP requests share the router
    assert dp2["long_replicas"] == [0, 1]         # the second found replica 0 busy with the first
    assert dp2["grpc_tokens"] == dp2["reference"] and dp2["http_tokens"] == dp2["reference"][0]


@pytest.mark.slow
def test_an_abort_reaches_the_replica_serving_the_request(dp2):
    """Request 7 was added on replica 0 and request 8 on replica 1: each is aborted there, while still running."""
    assert sorted(dp2["aborted"]) == [[0, "7", True], [1, "8", True]]
    stats = dp2["stats"]
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)


@pytest.mark.slow
def test_stats_and_metrics_are_summed_over_replicas(dp2):
    engines, stats, grpc_stats = dp2["engine_stats"], dp2["stats"], dp2["grpc_stats"]
    for key in ("kv_blocks_total", "compiles_after_start", "compiled_graphs", "prefix_cache_queries"):
        assert stats[key] == sum(e[key] for e in engines) and all(e[key] > 0 for e in engines), key
    assert stats["engine_steps"] == sum(dp2["replica_steps"]) and all(dp2["replica_steps"])
    assert {k: grpc_stats[k] for k in ("kv_blocks_total", "compiles_after_start")} == \
        {k: stats[k] for k in ("kv_blocks_total", "compiles_after_start")}
    assert stats["replicas_serving"] == 2 and grpc_stats["serving"]
    metric = re.search(r"^jaxserve_compiles_after_start_total (\S+)$", dp2["metrics"], re.M)
    assert float(metric.group(1)) == stats["compiles_after_start"]
    assert re.search(r"^jaxserve_replicas_serving 2\.0$", dp2["metrics"], re.M)


@pytest.mark.slow
def test_a_failed_replica_leaves_the_other_serving(dp2):
    one = dp2["one_failed"]
    assert one["error"].startswith("UNAVAILABLE") and "injected device failure" in one["error"]
    assert (one["health"], one["http_health"], one["failed"]) == ("SERVING", 200, False)
    assert one["stats"]["serving"] and one["stats"]["replicas_serving"] == 1
    assert one["after_tokens"] == dp2["reference"][2]


@pytest.mark.slow
def test_the_server_fails_once_no_replica_is_left(dp2):
    both = dp2["both_failed"]
    assert both["error"].startswith("UNAVAILABLE") and both["refused"].startswith("UNAVAILABLE")
    assert (both["health"], both["http_health"]) == ("NOT_SERVING", 503)
    assert not both["stats"]["serving"] and both["stats"]["replicas_serving"] == 0


def test_more_replicas_than_devices_is_an_error_naming_both_sizes():
    assert len(replica_meshes(1, 1)) == 1
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=1 needs 2 devices; 1 "
                                         r"available \(cpu\): lower either"):
        replica_meshes(2, 1)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int, got 0"):
        replica_meshes(0, 1)
    with pytest.raises(ValueError, match="needs 4 devices; 2 available"):
        replica_meshes(2, 2, devices=jax.devices() * 2)


@pytest.mark.slow
def test_serve_refuses_too_many_replicas_in_one_line_before_loading():
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--grpc-port", "0", "--no-metrics",
           "--data-parallel-size", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert re.fullmatch(r"jaxserve serve: error: data_parallel_size=2 x tensor_parallel_size=1 needs 2 devices; "
                        r"1 available \(cpu\): lower either", lines[0])


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):   # stdout: the JSON line only
        result = child()
    print(json.dumps(result))
