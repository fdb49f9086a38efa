"""`jaxserve serve` end to end (jaxserve/serve/server.py, grpc_api.py): one real server subprocess on loopback
(embedded SmolLM2 named as the positional MODEL, small engine, lazy compile) driven through the Python client, HTTP
and the CLI, its log read for the access lines; a second one over a tiny random model for --no-grpc and
--log-level; in-process servers over a fresh engine for TLS, the message-size limit and an injected engine failure.
The SIGTERM test stops the shared server: it stays last."""
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from custom_calls import cpu as cpu_calls
from jaxserve import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxserve.client import Client
from jaxserve.models.loader import embedded_model_path
from jaxserve.serve import jaxserve_pb2 as pb
from jaxserve.serve.server import SERVICE_NAME, ServeOptions, Server, serve_until_signal, stop_then_force

from benchmarks.serve_load import child_pids
from helpers import SERVER_KNOBS, TINY_HF_KWARGS, free_port, record_tokenize_threads

REPO = Path(__file__).resolve().parents[1]
MAX_WAITING = 48
GRACE_S = 20
READY_TIMEOUT_S = 300
IDLE_TIMEOUT_S = 60
SHARED = "You are a helpful assistant. Answer in one short sentence, and be precise. "   # > 1 KV block
PROMPTS = [(SHARED if i % 2 else "") + f"Question {i}: what is {i} plus {i * 7 % 13}, and why?" for i in range(32)]
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=10) for i in range(32)]
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)   # never finishes during a test
MODEL_PATH = embedded_model_path("smollm2-135m-instruct")   # the shared server's MODEL: its file stem names it
KNOB_FLAGS = [a for k, v in SERVER_KNOBS.items() for a in ("--" + k.replace("_", "-"), str(v))]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log: Path
    ready: dict[str, str] = field(default_factory=dict)   # the ready line's endpoints: grpc, http (its /v1 URL)

    def wait_ready(self) -> str:
        """The gRPC target ("" without gRPC), once the server is ready."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready:
            match = re.search(r"jaxserve serve: ready (.*)\n", self.log.read_text())
            if match:
                self.ready = dict(part.split("=", 1) for part in match[1].split())
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{self.log.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        return self.ready.get("grpc", "")

    @property
    def target(self) -> str:
        return self.ready["grpc"]

    @property
    def http_url(self) -> str:
        return self.ready["http"].removesuffix("/v1")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(GRACE_S + 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_server(log: Path, *flags: str) -> ServerProcess:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--no-precompile", *KNOB_FLAGS, *flags]
    with open(log, "w") as out:
        return ServerProcess(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                              env={**os.environ, "JAX_PLATFORMS": "cpu"}), log)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(tmp_path_factory.mktemp("serve") / "server.log", MODEL_PATH, "--port", "0",
                           "--grpc-port", "0", "--max-waiting", str(MAX_WAITING), "--grace-period", str(GRACE_S))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def offline(server, smollm):
    """The offline API over the same model and knobs (built while the server subprocess starts)."""
    return LLM(smollm, precompile=False, **SERVER_KNOBS)


@pytest.fixture(scope="module")
def reference(offline):
    return offline.generate(PROMPTS, SAMPLED, use_tqdm=False)


def run(scenario, target: str):
    async def main():
        async with Client(target) as client:
            return await scenario(client)
    return asyncio.run(main())


@dataclass
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    messages: list = field(default_factory=list)


async def collect(responses, stop_after: int | None = None) -> Collected:
    """Concatenate the deltas of output 0; stop_after: leave (cancelling the call) after that many messages."""
    got = Collected()
    async with contextlib.aclosing(responses) as stream:
        async for r in stream:
            got.messages.append(r)
            for chunk in r.outputs:
                got.text += chunk.text
                got.token_ids += chunk.token_ids
                got.finish_reason = chunk.finish_reason or got.finish_reason
            if len(got.messages) == stop_after:
                break
    return got


async def wait_idle(client: Client) -> pb.ServerStatsResponse:
    """Stats once nothing runs, waits or holds KV blocks (or the last seen, after IDLE_TIMEOUT_S)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        s = await client.server_stats()
        if not (s.running or s.waiting or s.pending or s.kv_blocks_used) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.1)


def assert_no_leak(stats: pb.ServerStatsResponse) -> None:
    assert (stats.running, stats.waiting, stats.pending) == (0, 0, 0)
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total > 0


@pytest.mark.slow
def test_concurrent_streams_match_offline_while_others_cancel(server, reference):
    rng = random.Random(0)
    cancel_after = [rng.randint(1, 4) for _ in range(8)]

    async def scenario(c: Client):
        full = [collect(c.generate(p, s)) for p, s in zip(PROMPTS, SAMPLED)]
        cut = [collect(c.generate(f"Tell a long story number {i}.", LONG), n) for i, n in enumerate(cancel_after)]
        mixed = full + cut
        order = rng.sample(range(len(mixed)), len(mixed))    # interleave the cancelled calls with the rest
        results = dict(zip(order, await asyncio.gather(*(mixed[i] for i in order))))
        return [results[i] for i in range(len(mixed))], await wait_idle(c)

    results, stats = run(scenario, server.wait_ready())
    for got, want in zip(results, reference):
        c = want.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (c.text, c.token_ids, c.finish_reason)
        last = got.messages[-1]
        assert last.finished and last.usage.completion_tokens == len(c.token_ids)
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert max(len(g.messages) for g in results[:32]) > 1                  # streamed, not sent in one piece
    for got, n in zip(results[32:], cancel_after):
        assert len(got.messages) == n and not got.messages[-1].finished
    assert_no_leak(stats)


@pytest.mark.slow
def test_complete_matches_stream_and_offline_logprobs(server, offline):
    prompt, params = PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)

    async def scenario(c: Client):
        return await c.complete(prompt, params), await collect(c.generate(prompt, params))

    full, streamed = run(scenario, server.wait_ready())
    want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    out = full.outputs[0]
    assert full.finished and (out.text, list(out.token_ids), out.finish_reason) == (want.text, want.token_ids, "length")
    assert (streamed.text, streamed.token_ids) == (want.text, want.token_ids)
    assert [lp.token_id for lp in out.logprobs] == want.token_ids
    for lp, expected in zip(out.logprobs, want.logprobs):
        assert {t.token_id: t.logprob for t in lp.top} == pytest.approx(expected, abs=1e-4)
        assert lp.top[0].token_id == lp.token_id and lp.logprob == max(t.logprob for t in lp.top) <= 0  # greedy


@pytest.mark.slow
def test_prompt_logprobs_come_back_with_the_last_message(server, offline):
    prompt, params = PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)

    async def scenario(c: Client):
        return await c.complete(prompt, params), [r async for r in c.generate(prompt, params)]

    full, stream = run(scenario, server.wait_ready())
    want = offline.generate([prompt], params, use_tqdm=False)[0]
    for got in (full.prompt_logprobs, stream[-1].prompt_logprobs):
        assert [lp.token_id for lp in got] == want.prompt_token_ids[1:]
        for lp, expected in zip(got, want.prompt_logprobs[1:]):
            assert {t.token_id: t.logprob for t in lp.top} == pytest.approx(expected, abs=1e-4)
    assert not any(r.prompt_logprobs for r in stream[:-1])


@pytest.mark.slow
def test_n_outputs_stream_per_index_with_stop_strings(server, offline):
    prompt, params = PROMPTS[5], SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, stop=["."])

    async def scenario(c: Client):
        streamed: dict[int, list] = {}
        async for r in c.generate(prompt, params):
            for chunk in r.outputs:
                text, ids, _ = streamed.get(chunk.index, ("", [], ""))
                streamed[chunk.index] = (text + chunk.text, ids + list(chunk.token_ids), chunk.finish_reason)
        return streamed, await c.complete(prompt, params)

    streamed, full = run(scenario, server.wait_ready())
    want = {c.index: c for c in offline.generate([prompt], params, use_tqdm=False)[0].outputs}
    assert sorted(streamed) == sorted(o.index for o in full.outputs) == sorted(want) == [0, 1, 2]
    for out in full.outputs:
        w = want[out.index]
        assert streamed[out.index] == (w.text, w.token_ids, w.finish_reason)
        assert (out.text, list(out.token_ids), out.finish_reason) == (w.text, w.token_ids, w.finish_reason)
        assert (out.stop_str if out.WhichOneof("stop_reason") == "stop_str" else None) == \
               (w.stop_reason if isinstance(w.stop_reason, str) else None)


@pytest.mark.slow
def test_tokenize_detokenize_and_model_info(server, smollm):
    text = "Hello world, this is jaxserve."

    async def scenario(c: Client):
        ids = await c.tokenize(text)
        return ids, await c.detokenize(ids), await c.tokenize(text, add_special_tokens=True), await c.model_info()

    ids, back, _, info = run(scenario, server.wait_ready())
    assert ids == smollm.tokenizer(text, add_special_tokens=False)["input_ids"] and back == text
    cfg = smollm.config
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == \
           (cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    assert (info.max_model_len, info.max_num_seqs, info.has_tokenizer) == (512, 16, True)


BAD_INPUTS = {
    "temperature": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(temperature=-1)), "temperature"),
    "top_p": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(top_p=0)), "top_p"),
    "n": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(n=0)), "n must"),
    "n>max_num_seqs": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(n=17)), "n=17"),
    "max_tokens": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(max_tokens=0)), "max_tokens"),
    "max_tokens-past-the-context": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(max_tokens=600)),
                                    "max_tokens=600 with the prompt's"),
    "min_tokens": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(min_tokens=5, max_tokens=2)),
                   "min_tokens"),
    "logprobs": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(logprobs=21)), "logprobs"),
    "stop_token_ids": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(stop_token_ids=[-1])),
                       "stop_token_ids"),
    "prompt-empty": (pb.GenerateRequest(prompt=""), "prompt is empty"),
    "prompt-both": (pb.GenerateRequest(prompt="Hi", prompt_token_ids=[1]), "prompt and prompt_token_ids"),
    "prompt-vocab": (pb.GenerateRequest(prompt_token_ids=[1, 2**40]), "prompt token ids"),
    "prompt-too-long": (pb.GenerateRequest(prompt_token_ids=[1] * 600), "max_model_len"),
    "prompt-id-flood": (pb.GenerateRequest(prompt_token_ids=[1] * 2_000_000), "prompt has 2,000,000 tokens"),
    "temperature-huge": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(temperature=1e30)),
                         "temperature must be in"),
    "repetition_penalty-tiny": (pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingOptions(repetition_penalty=1e-30)),
                                "repetition_penalty must be in"),
}


@pytest.mark.parametrize("rpc", ["Generate", "Complete"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.slow
def test_bad_input_is_invalid_argument_naming_the_field(server, case, rpc):
    request, field_name = BAD_INPUTS[case]

    async def scenario(c: Client):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call = getattr(c.stub, rpc)(request)
            await call if rpc == "Complete" else [r async for r in call]
        return err.value, await c.health(), await c.health(SERVICE_NAME), await c.server_stats()

    err, health, service_health, stats = run(scenario, server.wait_ready())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field_name in err.details()
    assert (health, service_health, stats.serving) == ("SERVING", "SERVING", True)


@pytest.mark.parametrize("ids, message", [([5, 49152], "token_ids must be in"),
                                          ([5] * 3_000_000, "at most max_model_len=512 ids, got 3,000,000")],
                         ids=["outside-vocabulary", "flood"])
@pytest.mark.slow
def test_detokenize_refuses_ids_outside_the_vocabulary_or_past_max_model_len(server, smollm, ids, message):
    assert smollm.config.vocab_size == 49152

    async def scenario(c: Client):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.detokenize(ids)
        return err.value, await c.health()

    err, health = run(scenario, server.wait_ready())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    assert health == "SERVING"


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.slow
def test_cancel_or_deadline_aborts_the_request_and_frees_its_blocks(server, how):
    async def scenario(c: Client):
        before = await wait_idle(c)
        if how == "cancel":
            got = await collect(c.generate("Count to a thousand:", LONG), stop_after=3)
            assert len(got.token_ids) >= 3 and not got.messages[-1].finished
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                # 1 s: ~100 steps of the embedded model on a CPU, well short of the half of LONG's 400 checked below
                await collect(c.generate("Count to a thousand:", LONG, timeout=1.0))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return before, await wait_idle(c)

    before, after = run(scenario, server.wait_ready())
    assert_no_leak(after)
    assert after.engine_steps - before.engine_steps < LONG.max_tokens // 2   # aborted, not run to max_tokens


@pytest.mark.slow
def test_resource_exhausted_past_max_waiting(server):
    short = SamplingParams(temperature=0.0, max_tokens=2)

    async def scenario(c: Client):
        async def seat(i):   # a long stream holding one of the max_num_seqs running seats until cancelled
            stream = c.generate(f"Story {i}:", LONG)
            await anext(stream)
            return stream
        seats = await asyncio.gather(*(seat(i) for i in range(SERVER_KNOBS["max_num_seqs"])))
        queued = [asyncio.ensure_future(c.complete(f"Queued {i}:", short)) for i in range(MAX_WAITING)]
        while (await c.server_stats()).pending < MAX_WAITING:
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.complete("One too many", short)
        for stream in seats:
            await stream.aclose()
        done = await asyncio.gather(*queued)
        return err.value, done, await wait_idle(c), await c.health()

    err, done, stats, health = run(scenario, server.wait_ready())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting" in err.details()
    assert all(r.finished and len(r.outputs[0].token_ids) == 2 for r in done)   # the queued ones still ran
    assert_no_leak(stats)
    assert health == "SERVING"


@pytest.mark.slow
def test_prometheus_metrics(server):
    async def scenario(c: Client):
        await c.complete("Metrics, please:", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        return await c.server_stats()

    stats = run(scenario, server.wait_ready())
    text = urllib.request.urlopen(server.http_url + "/metrics", timeout=10).read().decode()   # HTTP's, on --port
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    value = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]  # noqa: E731
    for histogram in ("time_to_first_token", "time_per_output_token", "inter_token_latency"):
        assert value(f"jaxserve_{histogram}_seconds_count") >= 1
    assert value("jaxserve_requests_total", outcome="finished") >= 1
    assert value("jaxserve_compiled_graphs") >= 1 and value("jaxserve_compiles_after_start_total") >= 0
    assert value("jaxserve_kv_blocks_free") == stats.kv_blocks_free
    # the embedded model on CPU: its GGUF's Q4_1 blocks (f32 where the CPU kernel does not run), an f32 cache
    weights = "q4_1" if cpu_calls.available() else "float32"
    assert (stats.weight_dtype, stats.kv_cache_dtype) == (weights, "float32")
    assert value("jaxserve_model_dtypes", weight_dtype=weights, kv_cache_dtype="float32") == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage", "prefix_cache_hit_rate",
                  "preemptions_total", "serving"):
        assert f"jaxserve_{gauge}" in {name for name, _ in samples}


@pytest.mark.slow
def test_http_on_port_answers_models_and_metrics(server):
    """--port serves the OpenAI API under the positional MODEL's name (a GGUF file: its stem), and Prometheus
    /metrics beside it."""
    server.wait_ready()
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=10) as response:
        assert [m["id"] for m in json.load(response)["data"]] == [MODEL_PATH.stem]
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as response:
        assert response.headers.get_content_type() == "text/plain" and b"\njaxserve_serving 1.0\n" in response.read()


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def access_lines(log: str, prompt_tokens: int, output_tokens: int, request_id: str = r"\d+") -> list[tuple[str, str]]:
    """(ttft, duration) of the access-log lines of finished requests with these counts."""
    return re.findall(rf"^INFO .* jaxserve\.serve\.metrics: request {request_id} finished: prompt_tokens="
                      rf"{prompt_tokens} output_tokens={output_tokens} ttft=(\d+\.\d+)s duration=(\d+\.\d+)s "
                      r"finish_reason=length$", log, re.M)


@pytest.mark.slow
def test_a_finished_request_is_one_access_log_line(server):
    """At the default --log-level info, over gRPC and HTTP alike: request id, prompt and output tokens, TTFT,
    duration and finish reason."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def scenario(c: Client):
        return await c.complete(PROMPTS[7], params)

    done = run(scenario, server.wait_ready())
    prompt = list(range(3, 26))
    served = post_json(server.http_url + "/v1/completions", {"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    log = server.log.read_text()
    [(ttft, duration)] = access_lines(log, done.usage.prompt_tokens, 5, done.request_id)
    assert 0 < float(ttft) <= float(duration)
    assert served["usage"]["completion_tokens"] == 3 and len(access_lines(log, len(prompt), 3)) == 1


@pytest.mark.slow
def test_reflection_lists_the_services(server):
    services = list_services(server.wait_ready())
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


@pytest.mark.slow
def test_cli_client_streams_the_offline_text(server, reference):
    host, port = server.wait_ready().rsplit(":", 1)
    s = SAMPLED[0]
    cmd = [sys.executable, "-m", "jaxserve.cli", "client", "--raw", "--host", host, "--port", port, "--max-tokens",
           str(s.max_tokens), "--temperature", str(s.temperature), "--top-p", str(s.top_p), "--seed", str(s.seed),
           PROMPTS[0]]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference[0].outputs[0].text + "\n"


@pytest.mark.parametrize("flags, match", [
    (["--port", "BUSY"], r"--port \d+ on --host 127.0.0.1: cannot bind"),
    (["--grpc-port", "BUSY"], r"--grpc-port \d+ on --host 127.0.0.1: cannot bind"),
    (["--metrics-port", "BUSY"], r"--metrics-port \d+ on --host 127.0.0.1: cannot bind"),
    (["--port", "50051", "--grpc-port", "50051"], "--grpc-port 50051: the same port as --port"),
    (["one.gguf", "--model", "other.gguf"], "MODEL one.gguf and --model other.gguf"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], "--tls-key /nonexistent"),
    (["--host", "192.0.2.1"], "--port 0 on --host 192.0.2.1: cannot bind"),   # TEST-NET: never this machine's
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive int"),
    (["--config", "/nonexistent.yaml"], "cannot read"),
], ids=["port-in-use", "grpc-port-in-use", "metrics-port-in-use", "same-port", "model-twice", "tls-file", "host",
        "engine-knob", "config"])
@pytest.mark.slow
def test_serve_refuses_bad_flags_in_one_line_before_loading_the_model(flags, match):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags = [str(busy.getsockname()[1]) if f == "BUSY" else f for f in flags]
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--grpc-port", "0", *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve serve: error:") and re.search(match, lines[0]), lines
    assert "loading weights" not in out.stderr


def thread_names(pid: int) -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on (Linux: its sockets' inodes in /proc/net/tcp and tcp6)."""
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    rows = [line.split() for table in ("tcp", "tcp6")
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]]
    return {int(row[1].rpartition(":")[2], 16) for row in rows if row[3] == "0A" and row[9] in inodes}   # 0A: LISTEN


@pytest.mark.slow
def test_the_engine_runs_in_a_process_of_its_own(server):
    """The server's process listens; the engine's, its child, only steps (the other child: multiprocessing's
    resource tracker)."""
    server.wait_ready()
    children = [pid for pid in child_pids(server.proc.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(children) == 1 and not listening_ports(children[0])
    # the server's process starts no JAX backend (on a GPU it would claim the device's memory): no XLA threads
    assert "tf_XLAEigen" in thread_names(children[0]) and "tf_XLAEigen" not in thread_names(server.proc.pid)


@pytest.mark.slow
def test_no_grpc_serves_http_alone_under_its_served_names_and_log_level_warning_drops_the_access_lines(tmp_path):
    """Also --no-engine-process: the engine on the server's threads, no child process."""
    config = tmp_path / "tiny.yaml"   # random weights: a fast start
    config.write_text(yaml.safe_dump({"model": "random", "dtype": "f32",
                                      "random_model": {"architectures": ["LlamaForCausalLM"], **TINY_HF_KWARGS}}))
    quiet = start_server(tmp_path / "quiet.log", "--config", str(config), "--port", "0", "--no-grpc",
                         "--log-level", "warning", "--served-model-name", "tiny-a", "tiny-b", "--no-engine-process")
    try:
        assert quiet.wait_ready() == "" and set(quiet.ready) == {"http"}
        assert listening_ports(quiet.proc.pid) == {int(quiet.http_url.rpartition(":")[2])}
        assert child_pids(quiet.proc.pid) == []
        with urllib.request.urlopen(quiet.http_url + "/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["tiny-a", "tiny-b"]
        served = post_json(quiet.http_url + "/v1/completions", {"model": "tiny-b", "prompt": list(range(3, 12)),
                                                                 "max_tokens": 3, "ignore_eos": True})
        assert served["usage"]["completion_tokens"] == 3 and served["model"] == "tiny-a"
    finally:
        quiet.stop()
    log = quiet.log.read_text()
    assert quiet.proc.returncode == 0 and "jaxserve serve: stopped" in log
    assert "finished: prompt_tokens=" not in log and not re.search(r"^INFO .* jaxserve\.", log, re.M), log


# ---- in-process servers over a fresh engine (no compile needed: nothing here runs a step) ----------------
@contextlib.asynccontextmanager
async def in_process(smollm, engine_knobs=None, **opts):
    knobs = {**SERVER_KNOBS, **(engine_knobs or {})}
    server = Server([LLMEngine(smollm, EngineConfig(precompile=False, **knobs))],
                    ServeOptions(**{"http_port": 0, "grpc_port": 0, "grace_period_s": 1.0, **opts}), ("smollm2",))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
@pytest.mark.slow
def test_tls_and_message_size_limit(smollm, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=jaxserve",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)

    async def scenario():
        async with in_process(smollm, tls_cert=str(cert), tls_key=str(key), max_message_bytes=4096) as server:
            target = f"127.0.0.1:{server.grpc_port}"
            async with Client(target, root_certificates=cert.read_bytes()) as c:
                ids = await c.tokenize("Hello over TLS")
                with pytest.raises(grpc.aio.AioRpcError) as too_big:
                    await c.tokenize("word " * 2000)
            async with Client(target) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as no_tls:
                    await asyncio.wait_for(plain.model_info(), 10)
            return ids, too_big.value, no_tls.value

    ids, too_big, no_tls = asyncio.run(scenario())
    assert ids == smollm.tokenizer("Hello over TLS", add_special_tokens=False)["input_ids"]
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert no_tls.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_api_key_guards_every_grpc_service_but_health_and_the_metrics_port(smollm):
    async def scenario():
        async with in_process(smollm, api_key="k3y", metrics_port=0) as server:
            target, metrics = f"127.0.0.1:{server.grpc_port}", f"http://127.0.0.1:{server.metrics_port}/metrics"
            async with Client(target) as anonymous, Client(target, api_key="wrong") as wrong, \
                    Client(target, api_key="k3y") as keyed:
                refused = [await error_code(anonymous.tokenize("Hi")), await error_code(wrong.model_info())]
                health = await anonymous.health()
                ids = await keyed.tokenize("Hi")
                lower_case = await keyed.stub.ModelInfo(pb.ModelInfoRequest(), metadata=(("authorization", "bearer k3y"),))
            reflection = await asyncio.to_thread(list_services_or_error, target)
            scrapes = [await asyncio.to_thread(http_status, metrics, headers) for headers in
                       ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "BEARER k3y"})]
            return refused, health, ids, lower_case.vocab_size, reflection, scrapes

    refused, health, ids, vocab, reflection, scrapes = asyncio.run(scenario())
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 2 and health == "SERVING"
    assert ids == smollm.tokenizer("Hi", add_special_tokens=False)["input_ids"] and vocab == 49152
    assert reflection == grpc.StatusCode.UNAUTHENTICATED
    assert scrapes == [401, 401, 200]


async def error_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def list_services_or_error(target: str):
    try:
        return list_services(target)
    except grpc.RpcError as e:
        return e.code()


def http_status(url: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_engine_failure_is_unavailable_and_not_serving(smollm):
    async def scenario():
        async with in_process(smollm) as server:
            def broken_step():
                raise RuntimeError("injected device failure")
            server.engine_loop.replicas[0].engine.step = broken_step
            async with Client(f"127.0.0.1:{server.grpc_port}") as c:
                healthy = await c.health()
                errors = []
                for call in (c.complete("Hello", SamplingParams(max_tokens=4)),   # hits the failing step
                             collect(c.generate("Hello again")), c.complete([1, 2, 3])):   # after it
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await asyncio.wait_for(call, 30)
                    errors.append(err.value)
                return (healthy, errors, await c.health(), await c.health(SERVICE_NAME), await c.server_stats(),
                        server.failed.is_set())

    healthy, errors, health, service_health, stats, failed = asyncio.run(scenario())
    assert healthy == "SERVING"
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "injected device failure" in e.details() for e in errors)
    assert (health, service_health, stats.serving, failed) == ("NOT_SERVING", "NOT_SERVING", False, True)


@pytest.mark.slow
def test_an_engine_failure_ends_serving_with_exit_code_1(smollm):
    """A supervisor restarts what exits non-zero: a failed engine must not leave a live, useless server."""
    async def scenario():
        engine, port = LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS)), free_port()
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("injected device failure"))
        serving = asyncio.create_task(serve_until_signal(
            [engine], ServeOptions(http_port=0, grpc_port=port, grace_period_s=1.0), ("smollm2",)))
        async with Client(f"127.0.0.1:{port}") as c:
            await asyncio.wait_for(c.channel.channel_ready(), 30)
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(c.complete([1, 2, 3]), 30)
        return await asyncio.wait_for(serving, 30)

    assert asyncio.run(scenario()) == 1


def test_a_second_signal_exits_without_draining(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = asyncio.Event()
    stop_then_force(stop)
    assert stop.is_set() and exits == []
    stop_then_force(stop)
    assert exits == [130]


@pytest.mark.slow
def test_refusals_get_their_status_and_nothing_reaches_the_engine_thread(smollm, monkeypatch):
    """Can never fit: RESOURCE_EXHAUSTED; a priority under fcfs, an oversized or undecodable request:
    INVALID_ARGUMENT; tokenization runs on the tokenizer thread, never the engine's."""
    threads = []
    record_tokenize_threads(monkeypatch, threads)

    async def scenario():
        async with in_process(smollm, engine_knobs=dict(num_blocks=24)) as server:
            target, codes = f"127.0.0.1:{server.grpc_port}", {}
            async with Client(target) as c:
                for name, call in (
                        ("never fits", c.complete(list(range(1, 300)), SamplingParams(max_tokens=200))),
                        ("priority", c.complete("Hi", priority=5)),
                        ("too many bytes", c.complete("word " * 200_000)),
                        ("tokenize", c.tokenize("word " * 200_000))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await asyncio.wait_for(call, 30)
                    codes[name] = (err.value.code(), err.value.details())
            async with grpc.aio.insecure_channel(target) as channel:
                raw = channel.unary_unary(f"/{SERVICE_NAME}/Complete")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw(b"\xff\xff\xff")
                codes["undecodable"] = (err.value.code(), err.value.details())
            return codes, server.engine_loop.stats()

    codes, stats = asyncio.run(scenario())
    assert codes["never fits"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokens" in codes["never fits"][1]
    assert codes["priority"][0] == grpc.StatusCode.INVALID_ARGUMENT and "priority" in codes["priority"][1]
    for name in ("too many bytes", "tokenize"):
        assert codes[name][0] == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in codes[name][1]
    assert codes["undecodable"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert threads and all(t.startswith("jaxserve-tokenizer") for t in threads)
    assert stats["waiting"] == stats["running"] == 0 and stats["serving"]


def list_services(target: str) -> set[str]:
    with grpc.insecure_channel(target) as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


@pytest.mark.slow
def test_reflection_can_be_turned_off(smollm):
    async def scenario():
        async with in_process(smollm, reflection=False) as server:
            return await asyncio.to_thread(list_services, f"127.0.0.1:{server.grpc_port}")

    with pytest.raises(grpc.RpcError) as err:
        asyncio.run(scenario())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- last: stops the shared server ---------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_the_in_flight_stream_and_exits_zero(server):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def scenario(c: Client):
        watch = c.health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
        statuses = [(await watch.read()).status]
        stream = c.generate(PROMPTS[1], params)
        first = await anext(stream)
        server.proc.send_signal(signal.SIGTERM)
        statuses.append((await watch.read()).status)
        watch.cancel()
        rest = await collect(stream)
        return statuses, first, rest

    statuses, first, rest = run(scenario, server.wait_ready())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert rest.messages[-1].finished and rest.finish_reason == "length"
    assert sum(len(c.token_ids) for c in first.outputs) + len(rest.token_ids) == params.max_tokens
    assert server.proc.wait(timeout=GRACE_S + 10) == 0
    assert "jaxserve serve: stopped" in server.log.read_text()


@pytest.mark.slow
def test_a_restart_on_the_drained_ports_starts_at_once(server, tmp_path):
    """The drain left the drained stream's connection in TIME-WAIT on the gRPC port (and the scrapes' on the HTTP
    one): a supervisor's immediate restart must bind them (the servers set SO_REUSEADDR, and so must the
    pre-check)."""
    assert server.proc.poll() is not None   # after the SIGTERM test
    restarted = start_server(tmp_path / "restart.log", "--port", server.http_url.rpartition(":")[2],
                             "--grpc-port", server.target.rpartition(":")[2])
    try:
        assert restarted.wait_ready() == server.target and restarted.http_url == server.http_url
    finally:
        restarted.proc.send_signal(signal.SIGTERM)
        assert restarted.proc.wait(GRACE_S + 30) == 0
