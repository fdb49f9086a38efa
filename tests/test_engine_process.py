"""The engines in a process of their own (jaxserve/serve/engine_process.py), as `jaxserve serve` runs them: outputs
sent as deltas rebuild every cumulative output; a server over an engine process answers as one over the same engine
on a thread (HTTP and gRPC, streams, n > 1, logprobs, stop strings, refusals); its death fails the server; an engine
that cannot start raises its error in the parent."""
import asyncio
import functools
import os
import pickle
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import openai
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.client import Client
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.models.loader import load_model
from jaxserve.serve.engine_process import DeltaEncoder, EngineProcess, rebuilt

from helpers import MODEL, SERVER_KNOBS, base_url, in_process, wait_idle


# ---- deltas ---------------------------------------------------------------------------------------------------------
def outputs_of_one_request() -> list[RequestOutput]:
    """A request's cumulative outputs as an engine gives them: a second choice from the second step, the engine's
    logprobs list running a token ahead, text held back then cut (a stop string), prompt logprobs."""
    logprobs = [{5: -0.5}, {6: -0.25}, {7: -1.0}, {8: -2.0}]   # one more than any output's tokens

    def out(step: int, finished=False) -> RequestOutput:
        first = CompletionOutput(0, ["He", "Hello wo", "Hello"][step], [5, 6, 7][:step + 1], -0.5 * (step + 1),
                                 logprobs, "stop" if finished else None, "wo" if finished else None)
        second = CompletionOutput(1, "ab"[:step], [9, 10][:step], None, None)
        return RequestOutput("r", "prompt", [1, 2, 3], [first, second][:1 + (step > 0)], finished,
                             [None, {2: -0.1}, {3: -0.2}], {"arrival_time": 1.0, "first_token_time": 2.0 + step})
    return [out(0), out(1), out(2, finished=True)]


def test_deltas_rebuild_every_cumulative_output():
    encoder, last = DeltaEncoder(), None
    for expected in outputs_of_one_request():
        delta = pickle.loads(pickle.dumps(encoder.delta(expected)))
        last = rebuilt(last, delta)
        for c in expected.outputs:
            if c.logprobs is not None:   # an output's logprobs are its tokens' (the front ends cut them so too)
                c.logprobs = c.logprobs[:len(c.token_ids)]
        assert last == expected
    assert encoder.sent == {}   # a finished request is forgotten


def test_a_delta_carries_only_what_is_new():
    encoder = DeltaEncoder()
    first, second, _ = outputs_of_one_request()
    encoder.delta(first)
    _, _, _, prompt, completions = encoder.delta(second)
    assert prompt is None
    assert [(c[0], c[2], c[4]) for c in completions] == [(0, "llo wo", [6]), (1, "a", [9])]


# ---- a server over an engine process --------------------------------------------------------------------------------
def smollm_engines(**knobs) -> list[LLMEngine]:
    """The engine process's build: the embedded model under the serving tests' knobs."""
    return [LLMEngine(load_model(dtype="f32"), EngineConfig(precompile=False, **SERVER_KNOBS, **knobs))]


def second_replica_fails() -> list[LLMEngine]:
    """Two engines, the second failing at its first step."""
    engines = smollm_engines() + smollm_engines()
    engines[1].step = lambda: (_ for _ in ()).throw(RuntimeError("injected device failure"))
    return engines


def cannot_start() -> list[LLMEngine]:
    raise ValueError("--model nowhere: no such file")


def served(server) -> dict:
    """What the front ends answer to a fixed set of requests, ids left out; then the server's stats once idle."""
    got = {}
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        batch = c.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=12,
                                     temperature=0, logprobs=2, stop=[" is", "5"])
        got["batch"] = [(ch.index, ch.text, ch.finish_reason, ch.logprobs.tokens) for ch in batch.choices]
        got["logprobs"] = [[lp for top in ch.logprobs.top_logprobs for lp in top.items()] for ch in batch.choices]
        stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=10, temperature=0.8, seed=7, n=2, stream=True, logprobs=True)
        pieces = {}
        for chunk in stream:
            for ch in chunk.choices:
                pieces.setdefault(ch.index, []).append((ch.delta.content, ch.finish_reason))
        got["stream"] = pieces
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        for body in ({"max_tokens": 100_000}, {"extra_body": {"response_format": bad_schema}}):
            with pytest.raises(openai.BadRequestError) as refused:
                c.completions.create(model=MODEL, prompt="Hi", **body)
            got.setdefault("refused", []).append(refused.value.message)

    async def over_grpc():
        async with Client(f"127.0.0.1:{server.grpc_port}") as client:
            done = await client.complete("Once upon a time", SamplingParams(max_tokens=10, temperature=0, logprobs=1))
            return [(o.text, list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in done.outputs]
    got["grpc"] = asyncio.run(over_grpc())
    stats = wait_idle(server)
    got["idle"] = {k: stats[k] for k in ("running", "waiting", "pending", "kv_blocks_used")}
    return got


@pytest.mark.slow
def test_a_server_over_an_engine_process_answers_as_over_a_thread(smollm):
    with in_process(LLMEngine(smollm, EngineConfig(precompile=False, **SERVER_KNOBS))) as server:
        on_thread = served(server)
    process = EngineProcess(smollm_engines)
    with in_process(process) as server:
        in_child = served(server)
        assert server.engine_loop.stats()["engine_steps"] > 0   # the child's stats reach the parent
    assert not process.process.is_alive()   # stopping the server stopped the process
    # a step's rows depend on when requests arrive, and each bucket's kernels round differently: logprobs agree to
    # f32 rounding over the model's layers, not bit for bit; everything else is the same
    for lps, expected in zip(in_child.pop("logprobs"), on_thread.pop("logprobs")):
        assert [t for t, _ in lps] == [t for t, _ in expected]
        np.testing.assert_allclose([lp for _, lp in lps], [lp for _, lp in expected], rtol=1e-4, atol=1e-4)
    assert in_child == on_thread
    assert on_thread["idle"] == {"running": 0, "waiting": 0, "pending": 0, "kv_blocks_used": 0}
    assert len(on_thread["stream"]) == 2 and "max_tokens" in on_thread["refused"][0]
    assert "response_format.json_schema.schema" in on_thread["refused"][1]


@pytest.mark.slow
def test_a_killed_engine_process_fails_its_requests_and_the_server():
    process = EngineProcess(smollm_engines)

    async def long_request(target: str):
        async with Client(target) as client:
            return await client.complete([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))

    with in_process(process) as server:
        target, loop = f"127.0.0.1:{server.grpc_port}", server.engine_loop.loop
        future = asyncio.run_coroutine_threadsafe(long_request(target), loop)
        deadline = time.monotonic() + 60
        while server.engine_loop.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(process.process.pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            future.result(30)
        deadline = time.monotonic() + 10
        while not server.failed.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        failed = server.failed.is_set()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine process exited (code -9)" in err.value.details()
    assert failed


@pytest.mark.slow
def test_a_failed_replica_of_an_engine_process_leaves_the_other_serving():
    params = SamplingParams(max_tokens=4, temperature=0)

    async def scenario(target: str) -> tuple:
        """Two requests at once: one on each replica; then one more, which only replica 0 can take."""
        async with Client(target) as client:
            first, second = await asyncio.gather(client.complete([1, 2, 3], params), client.complete([4, 5, 6], params),
                                                 return_exceptions=True)
            after = await client.complete([7, 8, 9], params)
            return first, second, after, await client.health()

    with in_process(EngineProcess(second_replica_fails)) as server:
        target = f"127.0.0.1:{server.grpc_port}"
        first, second, after, health = asyncio.run_coroutine_threadsafe(scenario(target),
                                                                        server.engine_loop.loop).result(120)
        stats = server.engine_loop.stats()
    failed = [r for r in (first, second) if isinstance(r, grpc.aio.AioRpcError)]   # whichever replica 1 took
    served = [r for r in (first, second, after) if not isinstance(r, Exception)]
    assert len(failed) == 1 and failed[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "injected device failure" in failed[0].details()
    assert len(served) == 2 and all(len(r.outputs[0].token_ids) == 4 for r in served)
    assert (health, stats["replicas_serving"], server.failed.is_set()) == ("SERVING", 1, False)


def test_an_engine_process_that_cannot_start_raises_its_error():
    with pytest.raises(ValueError, match="--model nowhere: no such file"):
        EngineProcess(cannot_start)


def test_an_engine_process_that_dies_starting_says_so():
    with pytest.raises(RuntimeError, match="exited with code 3 while starting"):
        EngineProcess(functools.partial(os._exit, 3))


# A Ctrl-C 2 s after the spawn (the engines building), taken by the main thread or by another (the kernel gives a
# process's signal to any thread), or inside Process.start() itself (the child already running); or with a child that
# ignores SIGTERM (killed after STOP_WAIT_S)
CTRL_C_AT = {"while_building": "threading.Timer(2, os.kill, (os.getpid(), signal.SIGINT)).start()",
             "taken_by_another_thread": "threading.Timer(2, lambda: signal.pthread_kill(threading.get_ident(), "
                                        "signal.SIGINT)).start()",
             "inside_the_spawn": """
from multiprocessing import context
start = context.SpawnProcess.start
def interrupted_start(self):
    start(self)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
context.SpawnProcess.start = interrupted_start""",
             "the_child_ignoring_sigterm": "signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the child inherits it\n"
                                           "threading.Timer(2, os.kill, (os.getpid(), signal.SIGINT)).start()"}


@pytest.mark.parametrize("when", CTRL_C_AT)
def test_ctrl_c_while_the_engines_start_stops_their_process(when):
    script = f"""
import faulthandler, functools, multiprocessing, os, signal, threading, time
faulthandler.dump_traceback_later(90, exit=True)   # where it hangs, if it does
signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C live, whatever the test runner's process left
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT, signal.SIGTERM}})
from jaxserve.serve.engine_process import EngineProcess
{CTRL_C_AT[when]}
try:
    EngineProcess(functools.partial(time.sleep, 600))
except KeyboardInterrupt:
    print("interrupted; processes left:", len(multiprocessing.active_children()))
"""
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:   # a process left holding the pipes: end them all, then say where it was
        os.killpg(run.pid, signal.SIGKILL)
        out, err = run.communicate()
    assert out.strip() == "interrupted; processes left: 0", err
