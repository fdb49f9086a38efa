"""Multi-host serving on one machine: two CPU processes, one device each, joined through JAX's coordination service
on 127.0.0.1, run one TP2 engine — through the engine API (tests/multihost_worker.py), then as `jaxserve serve`.
Process 0 schedules and publishes every step; process 1 launches the same graphs. The tokens must be one device's,
and process 1 must leave when process 0 does."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client
from jaxserve.config import model_config_from_hf
from jaxserve.engine.distributed import Cluster, cluster_from
from jaxserve.models.loader import random_model
from multihost_worker import LAZY, TINY_HF, outputs
from test_compilation import TINY

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 180
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}   # one CPU device per process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:   # files, not pipes: a process blocked on a full pipe would stall the other
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=ENV)


def finish(procs: list[subprocess.Popen]) -> list[int]:
    try:
        return [p.wait(TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def last_json(log: Path) -> dict:
    return json.loads(log.read_text().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_device() -> dict:
    """The same model and requests on one device, in this process."""
    return outputs(LLM(random_model(TINY, jnp.float32), **LAZY))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[list[int], dict, dict]:
    logs, port = tmp_path_factory.mktemp("multihost"), free_port()
    procs = [start([sys.executable, str(WORKER), str(i), str(port)], logs / f"{i}.log") for i in (0, 1)]
    codes = finish(procs)
    assert codes == [0, 0], "\n".join((logs / f"{i}.log").read_text()[-3000:] for i in (0, 1))
    return codes, last_json(logs / "0.log"), last_json(logs / "1.log")


def test_tp2_across_two_processes_matches_one_device(two_processes, one_device):
    _, leader, _ = two_processes
    assert leader["processes"] == [0, 1]   # the mesh spans both processes
    assert leader["tokens"] == one_device["tokens"]
    np.testing.assert_allclose(np.concatenate(leader["logprobs"]), np.concatenate(one_device["logprobs"]), atol=1e-4)


def test_the_worker_runs_every_published_step_then_exits(two_processes):
    codes, leader, worker = two_processes
    assert codes == [0, 0] and worker["steps"] == leader["published"] > 0


def test_each_process_keys_its_own_executables(two_processes):
    """Same mesh, model and config: only the process tells their executables apart in a shared cache."""
    _, leader, worker = two_processes
    assert leader["fingerprint"] != worker["fingerprint"]


def serve_cluster(tmp_path: Path, *flags: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """`jaxserve serve` of the tiny random model as a TP2 engine over two processes: (processes, their logs)."""
    config = tmp_path / "tiny.yaml"
    engine = {k: list(v) if isinstance(v, tuple) else v for k, v in LAZY.items() if k != "precompile"}
    config.write_text(yaml.safe_dump({"model": "random", "dtype": "f32", "random_model": TINY_HF,
                                      "engine": {**engine, "tensor_parallel_size": 2}}))
    port, logs = free_port(), [tmp_path / "leader.log", tmp_path / "worker.log"]
    procs = [start([sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(config), "--port", "0",
                    "--no-metrics", "--no-precompile", *flags, "--coordinator-address", f"127.0.0.1:{port}",
                    "--num-processes", "2", "--process-id", str(i)], logs[i]) for i in (0, 1)]
    return procs, logs


def test_jaxserve_serve_across_two_processes(tmp_path):
    """The leader serves gRPC, the worker follows; SIGTERM to the leader drains it, and the worker leaves too."""
    assert model_config_from_hf(TINY_HF) == TINY
    procs, logs = serve_cluster(tmp_path, "--grace-period", "5")
    try:
        target = wait_ready(procs[0], logs[0])
        served = asyncio.run(complete(target, [[3, 4, 5, 6, 7], list(range(10, 50))]))
        procs[0].send_signal(signal.SIGTERM)
    finally:
        codes = finish(procs)
    expected = LLM(random_model(TINY, jnp.float32), **LAZY).generate(
        [[3, 4, 5, 6, 7], list(range(10, 50))], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert served == [o.outputs[0].token_ids for o in expected]
    assert codes == [0, 0], logs[1].read_text()[-3000:]
    assert re.search(r"stopped after [1-9]\d* steps", logs[1].read_text())


def test_a_dead_worker_ends_the_leader_within_the_heartbeat_timeout(tmp_path):
    """SIGKILL to the worker: the leader must not hang on its collectives; the coordination service ends it (exit
    code != 0, for a supervisor to restart the cluster) within about HEARTBEAT_TIMEOUT_S."""
    from jaxserve.engine.distributed import HEARTBEAT_TIMEOUT_S
    procs, logs = serve_cluster(tmp_path)
    try:
        wait_ready(procs[0], logs[0])
        procs[1].kill()
        killed = time.monotonic()
        code = procs[0].wait(4 * HEARTBEAT_TIMEOUT_S)
        assert code != 0 and time.monotonic() - killed < 3 * HEARTBEAT_TIMEOUT_S, logs[0].read_text()[-2000:]
    finally:
        finish(procs)


def wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while not (match := re.search(r"ready grpc=(\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the leader did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return match.group(1)


async def complete(target: str, prompts: list[list[int]]) -> list[list[int]]:
    async with Client(target) as client:
        return [list((await client.complete(p, SamplingParams(temperature=0.0, max_tokens=8))).outputs[0].token_ids)
                for p in prompts]


def test_cluster_flags_fall_back_to_the_environment_and_are_checked():
    env = {"JAXSERVE_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXSERVE_NUM_PROCESSES": "4",
           "JAXSERVE_PROCESS_ID": "3"}
    assert cluster_from(environ={}) is None
    assert cluster_from(environ=env) == Cluster("10.0.0.1:1234", 4, 3)
    assert cluster_from(process_id=0, environ=env).is_leader
    assert cluster_from("h:1", 1, 0, environ={}) is None   # one process: nothing to join
    for kwargs, message in [
            (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"--process-id 2 must be in \[0, 2\)"),
            (dict(coordinator_address="h:1", num_processes=2, process_id=-1), r"--process-id -1 must be in"),
            (dict(coordinator_address="h:1", num_processes=2), "missing --process-id"),
            (dict(coordinator_address="h", num_processes=2, process_id=0), "must be HOST:PORT"),
            (dict(coordinator_address="h:1", num_processes=0, process_id=0), "--num-processes must be >= 1"),
            (dict(environ={**env, "JAXSERVE_NUM_PROCESSES": "two"}), r"--num-processes \(JAXSERVE_NUM_PROCESSES\) "
                                                                     "must be an int, got 'two'")]:
        with pytest.raises(ValueError, match=message):
            cluster_from(**{"environ": {}, **kwargs})


@pytest.mark.parametrize("flags, match", [
    (["--process-id", "2"], r"--process-id 2 must be in \[0, 2\) for --num-processes 2"),
    (["--process-id", "1", "--data-parallel-size", "2"], "--data-parallel-size: a multi-host engine is one replica"),
], ids=["process-id", "data-parallel"])
def test_bad_cluster_flags_are_one_line_errors_before_anything_starts(flags, match):
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--no-metrics", "--coordinator-address",
           f"127.0.0.1:{free_port()}", "--num-processes", "2", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120, env=ENV)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and re.search(match, lines[0]), out.stderr
    assert lines[0].startswith("jaxserve serve: error:")


def test_a_mesh_short_of_the_cluster_is_refused_in_every_process(tmp_path):
    """--tensor-parallel-size must count every device of every process (one engine over all of them): with the
    default 1, each process says so and exits, none waits for the other forever."""
    port, logs = free_port(), [tmp_path / "leader.log", tmp_path / "worker.log"]
    procs = [start([sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--no-metrics",
                    "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                   logs[i]) for i in (0, 1)]
    assert finish(procs) == [2, 2]
    for log in logs:
        assert re.search(r"--tensor-parallel-size 1: a multi-host engine spans every device of its 2 processes; "
                         r"set it to 2", log.read_text()), log.read_text()[-2000:]
