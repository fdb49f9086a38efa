"""Multi-host serving (jaxserve/engine/distributed.py, step_codec.py) on one machine: two CPU processes, one device
each, joined through JAX's coordination service on 127.0.0.1, run one TP2 engine — through the engine API
(tests/multihost_worker.py), then as `jaxserve serve`. Process 0 schedules and publishes every step; process 1
launches the same graphs. The tokens must be one device's, and process 1 must leave when process 0 does. A value
planted in the step channel (a pickle, a forged step) must be refused: by its MAC under JAXSERVE_CLUSTER_SECRET, by
the step format without one."""
import asyncio
import dataclasses
import json
import os
import pickle
import re
import signal
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
from jaxserve.engine import step_codec
from jaxserve.engine.distributed import STOP, Cluster, Seal, StepReader, cluster_from, step_key
from jaxserve.models.loader import random_model

from helpers import TINY, free_port
from multihost_worker import LAZY, TINY_HF, Planted, outputs

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 180
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}   # one CPU device per process
SECRET = {"JAXSERVE_CLUSTER_SECRET": "a test secret"}


def start(cmd: list[str], log: Path, env: dict = ENV) -> subprocess.Popen:
    with open(log, "w") as out:   # files, not pipes: a process blocked on a full pipe would stall the other
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)


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
    """The same model and requests on one device, in this process; "steps": the DeviceSteps its runner launched."""
    llm, steps = LLM(random_model(TINY, jnp.float32), **LAZY), []
    llm.engine.runner.on_launch = steps.append
    return {**outputs(llm), "steps": steps}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[list[int], dict, dict]:
    """With a cluster secret, and a pickle planted under the first step's key: (exit codes, the leader's JSON, the
    worker's JSON with its "log" and whether the pickle's "marker" file exists)."""
    logs, port = tmp_path_factory.mktemp("multihost"), free_port()
    marker = logs / "unpickled"
    procs = [start([sys.executable, str(WORKER), str(i), str(port), str(marker)], logs / f"{i}.log", {**ENV, **SECRET})
             for i in (0, 1)]
    codes = finish(procs)
    assert codes == [0, 0], "\n".join((logs / f"{i}.log").read_text()[-3000:] for i in (0, 1))
    worker = {**last_json(logs / "1.log"), "log": (logs / "1.log").read_text(), "marker": marker.exists()}
    return codes, last_json(logs / "0.log"), worker


@pytest.mark.slow
def test_tp2_across_two_processes_matches_one_device(two_processes, one_device):
    _, leader, _ = two_processes
    assert leader["processes"] == [0, 1]   # the mesh spans both processes
    assert leader["tokens"] == one_device["tokens"]
    np.testing.assert_allclose(np.concatenate(leader["logprobs"]), np.concatenate(one_device["logprobs"]), atol=1e-4)


@pytest.mark.slow
def test_the_worker_runs_every_published_step_then_exits(two_processes):
    codes, leader, worker = two_processes
    assert codes == [0, 0] and worker["steps"] == leader["published"] > 0


@pytest.mark.slow
def test_a_planted_pickle_is_refused_by_its_mac_and_has_no_effect(two_processes):
    """The worker read it first (logged once, however often it read it again), never unpickled it, and ran the
    leader's step 0 that replaced it: the tokens above are one device's."""
    _, _, worker = two_processes
    assert not worker["marker"]
    assert worker["log"].count("rejected a value under jaxserve/steps/0/0, not the leader's: its MAC does not "
                               "verify") == 1, worker["log"][-3000:]


@pytest.mark.slow
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
                    "--grpc-port", "0", "--no-metrics", "--no-precompile", *flags, "--coordinator-address",
                    f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], logs[i]) for i in (0, 1)]
    return procs, logs


@pytest.mark.slow
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


@pytest.mark.slow
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
           "JAXSERVE_PROCESS_ID": "3", **SECRET}
    assert cluster_from(environ={}) is None
    assert cluster_from(environ=env) == Cluster("10.0.0.1:1234", 4, 3, b"a test secret")
    assert cluster_from(process_id=0, environ=env).is_leader
    assert cluster_from("h:1", 1, 0, environ={}) is None   # one process: nothing to join
    for loopback in ("127.0.0.1:1", "127.0.0.2:1", "localhost:1", "[::1]:1"):   # no secret needed
        assert cluster_from(loopback, 2, 1, environ={}) == Cluster(loopback, 2, 1)
    for kwargs, message in [
            (dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0),
             "--coordinator-address 10.0.0.1:1234 is reachable from other hosts.*set JAXSERVE_CLUSTER_SECRET"),
            (dict(coordinator_address="h:1", num_processes=2, process_id=1, environ={"JAXSERVE_CLUSTER_SECRET": ""}),
             "h:1 is reachable from other hosts"),
            (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"--process-id 2 must be in \[0, 2\)"),
            (dict(coordinator_address="h:1", num_processes=2, process_id=-1), r"--process-id -1 must be in"),
            (dict(coordinator_address="h:1", num_processes=2), "missing --process-id"),
            (dict(coordinator_address="h", num_processes=2, process_id=0), "must be HOST:PORT"),
            (dict(coordinator_address="h:1", num_processes=0, process_id=0), "--num-processes must be >= 1"),
            (dict(environ={**env, "JAXSERVE_NUM_PROCESSES": "two"}), r"--num-processes \(JAXSERVE_NUM_PROCESSES\) "
                                                                     "must be an int, got 'two'")]:
        with pytest.raises(ValueError, match=message):
            cluster_from(**{"environ": {}, **kwargs})


@pytest.mark.slow
@pytest.mark.parametrize("flags, match", [
    (["--process-id", "2"], r"--process-id 2 must be in \[0, 2\) for --num-processes 2"),
    (["--process-id", "1", "--data-parallel-size", "2"], "--data-parallel-size: a multi-host engine is one replica"),
    (["--process-id", "0", "--coordinator-address", "10.0.0.1:1234"],
     "--coordinator-address 10.0.0.1:1234 is reachable from other hosts.*set JAXSERVE_CLUSTER_SECRET to the same "
     "random value in every process"),
], ids=["process-id", "data-parallel", "no-secret"])
def test_bad_cluster_flags_are_one_line_errors_before_anything_starts(flags, match):
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--grpc-port", "0", "--no-metrics",
           "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2",
           *flags]   # the last --coordinator-address counts
    env = {k: v for k, v in ENV.items() if k != "JAXSERVE_CLUSTER_SECRET"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and re.search(match, lines[0]), out.stderr
    assert lines[0].startswith("jaxserve serve: error:")


@pytest.mark.slow
def test_a_mesh_short_of_the_cluster_is_refused_in_every_process(tmp_path):
    """--tensor-parallel-size must count every device of every process (one engine over all of them): with the
    default 1, each process says so and exits, none waits for the other forever."""
    port, logs = free_port(), [tmp_path / "leader.log", tmp_path / "worker.log"]
    procs = [start([sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--grpc-port", "0", "--no-metrics",
                    "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                   logs[i]) for i in (0, 1)]
    assert finish(procs) == [2, 2]
    for log in logs:
        assert re.search(r"--tensor-parallel-size 1: a multi-host engine spans every device of its 2 processes; "
                         r"set it to 2", log.read_text()), log.read_text()[-2000:]


def test_every_kind_of_step_survives_the_codec(one_device):
    steps = one_device["steps"]
    assert any(s.copies for s in steps) and any(s.resets for s in steps)   # forks, penalties
    assert any(s.inputs and s.inputs.next_prompt_ids is not None for s in steps)   # prompt logprobs
    for step in steps:
        data = step_codec.encode(step)
        assert_same(step_codec.decode(data), step)
        assert step_codec.encode(step_codec.decode(data)) == data


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        assert len(a) == len(b) and all(assert_same(x, y) is None for x, y in zip(a, b))
    else:
        assert a == b


def reheader(data: bytes, pattern: str, new: str) -> bytes:
    """data with its JSON header edited: the first match of pattern replaced by new."""
    start = len(step_codec.MAGIC) + step_codec.HEADER_LEN.size
    (size,) = step_codec.HEADER_LEN.unpack_from(data, len(step_codec.MAGIC))
    header, n = re.subn(pattern, new, data[start:start + size].decode(), count=1)
    assert n == 1
    header = header.encode()
    return step_codec.MAGIC + step_codec.HEADER_LEN.pack(len(header)) + header + data[start + size:]


@pytest.mark.parametrize("hostile, match", [
    (lambda data, marker: pickle.dumps(Planted(marker)), "not an encoded step"),
    (lambda data, marker: pickle.dumps(step_codec.decode(data)), "not an encoded step"),
    (lambda data, marker: reheader(data, '"<i4"', '"|O"'), r"array dtype '\|O' is not one of"),
    (lambda data, marker: reheader(data, r'"<i4",\[', '"<i4",[1099511627776,1099511627776,'), "runs past the end"),
    (lambda data, marker: data[:-1], "runs past the end"),
    (lambda data, marker: data + b"\0", "1 bytes past the last array"),
    (lambda data, marker: reheader(data, '"type":"StepInputs"', '"type":"Popen"'), "unknown type 'Popen'"),
    (lambda data, marker: reheader(data, '"fields":{', '"fields":{"args":1,'), "DeviceStep with fields"),
    (lambda data, marker: reheader(data, '{"type":"DeviceStep",', '{"tuple":[],"type":"DeviceStep",'),
     "unexpected dict"),
    (lambda data, marker: reheader(data, r'"num_logprobs":\d+', '"num_logprobs":0.5'), "unexpected float"),
    (lambda data, marker: step_codec.MAGIC + step_codec.HEADER_LEN.pack(2 ** 31) + b"{}", "header of 2147483648"),
    (lambda data, marker: step_codec.MAGIC + step_codec.HEADER_LEN.pack(10 ** 5) + b"[" * 10 ** 5,
     "header is not JSON"),
], ids=["pickle", "pickled-step", "object-dtype", "huge-shape", "truncated", "trailing", "unknown-type",
        "extra-field", "bad-node", "float", "huge-header", "deep-json"])
def test_anything_but_an_encoded_step_is_refused(one_device, tmp_path, hostile, match):
    step = next(s for s in one_device["steps"] if s.inputs is not None)
    marker = tmp_path / "unpickled"
    with pytest.raises(step_codec.StepFormatError, match=match):
        step_codec.decode(hostile(step_codec.encode(step), str(marker)))
    assert not marker.exists()


def test_a_value_verifies_only_under_its_key_in_its_run():
    seal, key = Seal(b"secret", b"run-1"), step_key(5)
    value = seal.seal(key, b"payload")
    assert seal.open(key, value) == b"payload"
    for other, where, forged in [(seal, step_key(6), value), (Seal(b"secret", b"run-2"), key, value),
                                 (Seal(b"guess", b"run-1"), key, value), (seal, key, value[:-1] + b"!"),
                                 (seal, key, b"payload")]:
        with pytest.raises(ValueError, match="its MAC does not verify"):
            other.open(where, forged)
    assert Seal().seal(key, b"payload") == Seal().open(key, b"payload") == b"payload"   # no secret: the format only


class Store:
    """A coordination client whose reads of a key give `values[key]` in turn, its last one from then on."""

    def __init__(self, values: dict[str, list[bytes]]):
        self.values = values

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        values = self.values[key]
        return values.pop(0) if len(values) > 1 else values[0]


def test_a_worker_skips_planted_values_until_the_leaders_lands(one_device, tmp_path, capfd):
    """No secret: refused by the format. A planted pickle read three times is not run and is logged once; the
    leader's value that replaces it is."""
    step, marker = one_device["steps"][0], tmp_path / "unpickled"
    planted = pickle.dumps(Planted(str(marker)))
    reader = StepReader(Store({step_key(0): [planted] * 3 + [step_codec.encode(step)], step_key(1): [STOP]}),
                        Seal(), 1)
    assert_same(reader.read(), step)
    assert reader.read() is None and not marker.exists()
    assert capfd.readouterr().err.count("jaxserve: process 1: rejected a value under jaxserve/steps/0/0, not the "
                                        "leader's: not an encoded step") == 1
