"""Multi-host serving: one engine over the devices of several processes, its tensor-parallel mesh spanning them
(`jaxserve serve --coordinator-address HOST:PORT --num-processes N --process-id I`, or the JAXSERVE_* variables).

Every process loads the model onto the global mesh and builds the same ModelRunner, holding its own shards of the
weights and the KV cache; only process 0, the leader, runs the server, the scheduler and the runner's host work.
A step is SPMD: every process must launch each of its device programs in the same order with the same inputs, or
their collectives never meet. So before launching a step the leader publishes its host-side input, the runner's
`DeviceStep` (block copies, penalty resets, the bucketed numpy inputs), as step N; each worker loops: get step N,
launch the same compiled graphs on it, drop the outputs. A stop message at shutdown ends the workers.

The channel is the key-value store of JAX's coordination service (the `jax.distributed` service, which runs in the
leader's process): one `key_value_set_bytes` per step on the leader, a blocking get per step on each worker. Not
`multihost_utils.broadcast_one_to_all`: that is a device collective of one fixed shape per call, while a step's
inputs change shape with its bucket, sampler mode and which programs it runs; and it would put another device
program and a host sync in front of every step on the leader, whose hot path this keeps to one local RPC (the
workers wait, never the leader). Steps travel as pickles: the coordination service, like JAX's own use of it, must
be reachable from the cluster's hosts only.

The step's samples and logprobs are replicated over the mesh (the runner's out_shardings), so the leader reads them
from its own shard. On CPU, cross-process programs need jax_cpu_collectives_implementation "gloo" (without one
they fail: "Multiprocess computations aren't implemented on the CPU backend"); it is jax 0.11.2's default, set
here so that no other default can take it away.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import pickle
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import jax
from jax._src import distributed as jax_distributed

FLAGS = {"coordinator_address": ("--coordinator-address", "JAXSERVE_COORDINATOR_ADDRESS"),
         "num_processes": ("--num-processes", "JAXSERVE_NUM_PROCESSES"),
         "process_id": ("--process-id", "JAXSERVE_PROCESS_ID")}
STEPS_PER_CHUNK = 16    # step keys live in chunks; the leader deletes a chunk once every worker is past it
STOP = b"stop"          # never a pickle (those start with b"\x80")
WAIT_MS = 60_000        # a worker's get, retried for as long as the server idles
MAX_INFLIGHT_STEPS = 2  # a worker's launched steps not yet done, as the leader's engine (async scheduling)
# A process silent this long is dead, and the coordination service ends the others (their steps' collectives would
# wait on it forever): a supervisor then restarts the cluster. JAX's default, 100 s, left a dead worker's leader
# hanging that long with every request in it.
HEARTBEAT_TIMEOUT_S = 15


@dataclass(frozen=True, slots=True)
class Cluster:
    coordinator_address: str   # HOST:PORT of process 0, where JAX's coordination service listens
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def cluster_from(coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, environ: Mapping[str, str] = os.environ) -> Cluster | None:
    """The cluster the flags (each falling back to its environment variable) describe; None for one process.
    A missing or bad value is a ValueError naming the flag."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    values = {name: environ.get(FLAGS[name][1]) if value is None else value for name, value in given.items()}
    if all(value is None for value in values.values()):
        return None
    if missing := [FLAGS[name][0] for name, value in values.items() if value is None]:
        raise ValueError(f"multi-host serving needs --coordinator-address, --num-processes and --process-id "
                         f"together (or {', '.join(env for _, env in FLAGS.values())}); missing {', '.join(missing)}")
    num, pid, address = as_int(values, "num_processes"), as_int(values, "process_id"), values["coordinator_address"]
    if num < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num}")
    if not 0 <= pid < num:
        raise ValueError(f"--process-id {pid} must be in [0, {num}) for --num-processes {num}: number the processes "
                         f"0 to {num - 1}, 0 being the one that serves")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator-address must be HOST:PORT (process 0's host, a free port), got {address!r}")
    return None if num == 1 else Cluster(address, num, pid)


def as_int(values: dict, name: str) -> int:
    try:
        return int(values[name])
    except ValueError:
        flag, env = FLAGS[name]
        raise ValueError(f"{flag} ({env}) must be an int, got {values[name]!r}") from None


def initialize(cluster: Cluster | None, tensor_parallel_size: int) -> None:
    """Join the cluster (jax.distributed.initialize, which waits for every process): before any device is touched.
    The engine is one tensor-parallel mesh over every device of every process (a process without a shard of it
    would have nothing to run), so tensor_parallel_size must count them all: checked in every process."""
    if cluster is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes, cluster.process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    if tensor_parallel_size != jax.device_count():
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size}: a multi-host engine spans every device of "
                         f"its {cluster.num_processes} processes; set it to {jax.device_count()}")


def coordination_client():
    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: call distributed.initialize first")
    return client


def step_key(step: int) -> str:
    return f"jaxserve/steps/{step // STEPS_PER_CHUNK}/{step}"


class StepPublisher:
    """The leader's side: each DeviceStep under the next step number, then STOP."""

    def __init__(self, client):
        self.client, self.step = client, 0

    def publish(self, step) -> None:
        self._put(pickle.dumps(step, pickle.HIGHEST_PROTOCOL))

    def stop(self) -> None:
        self._put(STOP)

    def _put(self, data: bytes) -> None:
        chunk, index = divmod(self.step, STEPS_PER_CHUNK)
        # Every worker is past the chunk before last: the leader syncs each model step's samples before it
        # publishes the step after next, and those samples need every process's shard of the step.
        if index == 0 and chunk >= 2:
            self.client.key_value_delete(f"jaxserve/steps/{chunk - 2}")
        self.client.key_value_set_bytes(step_key(self.step), data)
        self.step += 1


@contextlib.contextmanager
def leading(cluster: Cluster | None, runner) -> Iterator[StepPublisher | None]:
    """On the leader (nothing to do without a cluster): each step `runner` launches inside the block is published
    first; after it, the stop message, then the cluster's shutdown, which waits for every worker to leave."""
    if cluster is None:
        yield None
        return
    publisher = StepPublisher(coordination_client())
    runner.on_launch = publisher.publish
    try:
        yield publisher
    finally:
        runner.on_launch = None
        publisher.stop()
        jax.distributed.shutdown()


def follow(runner) -> int:
    """A worker's loop: launch each step the leader publishes, outputs dropped, until the stop message; then leave
    the cluster. The number of steps run. Steps in flight are bounded as on the leader: XLA:CPU deadlocks past 32
    multi-device programs in flight per device (tests/tp_worker.py)."""
    client, inflight = coordination_client(), deque()
    for step in itertools.count():
        data = wait_for(client, step_key(step))
        if data == STOP:
            break
        inflight.append(runner.launch(pickle.loads(data)))
        if len(inflight) > MAX_INFLIGHT_STEPS:
            jax.block_until_ready(inflight.popleft())
    jax.block_until_ready(list(inflight))
    jax.distributed.shutdown()
    return step


def wait_for(client, key: str) -> bytes:
    """The value of key, however long the leader idles; any other error (the leader gone) raises."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, WAIT_MS)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
