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
workers wait, never the leader).

Whoever reaches the coordination port can list, read, write and delete its keys (JAX's service asks for no
credentials), so a worker trusts nothing it reads there:
- A step holds no code: engine/step_codec.py writes a JSON header and raw array bytes, and reads back only the
  step's own dataclasses and arrays of numeric dtypes (a pickle would run whatever it names).
- With JAXSERVE_CLUSTER_SECRET (the same in every process; required unless the coordinator address is loopback),
  every value carries an HMAC-SHA256 over the key it is stored under and its payload, keyed also by this run's
  process incarnations: a forged value, or a genuine one moved to another key or replayed from an earlier run,
  is refused. Without one (loopback only), another user of the host can still publish well-formed steps: wrong
  outputs or a stall, never code.
- A refused value is not run: the worker logs it and reads the key again until the leader's value, which
  overwrites whatever was planted there first, verifies.
- The service listens on the coordinator address only (JAX's default is every interface).
What stays trusted: the channel is not encrypted (anyone reaching the port reads the prompts' token ids), and
anyone reaching it can stall the cluster (delete a step, or overwrite the leader's with junk). So the port
must still be reachable from the cluster's hosts only; the secret keeps a peer that does reach it from running
code or steps of its own on the workers.

The step's samples and logprobs are replicated over the mesh (the runner's out_shardings), so the leader reads them
from its own shard. On CPU, cross-process programs need jax_cpu_collectives_implementation "gloo" (without one
they fail: "Multiprocess computations aren't implemented on the CPU backend"); it is jax 0.11.2's default, set
here so that no other default can take it away.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import jax
from jax._src import distributed as jax_distributed

from jaxserve.engine import step_codec

FLAGS = {"coordinator_address": ("--coordinator-address", "JAXSERVE_COORDINATOR_ADDRESS"),
         "num_processes": ("--num-processes", "JAXSERVE_NUM_PROCESSES"),
         "process_id": ("--process-id", "JAXSERVE_PROCESS_ID")}
STEPS_PER_CHUNK = 16    # step keys live in chunks; the leader deletes a chunk once every worker is past it
SECRET_ENV = "JAXSERVE_CLUSTER_SECRET"   # an environment variable only: a flag would show in `ps`
STOP = b"stop"          # never an encoded step (those start with step_codec.MAGIC)
WAIT_MS = 60_000        # a worker's get, retried for as long as the server idles
MAX_INFLIGHT_STEPS = 2  # a worker's launched steps not yet done, as the leader's engine (async scheduling)
# A process silent this long is dead, and the coordination service ends the others (their steps' collectives would
# wait on it forever): a supervisor then restarts the cluster. JAX's much longer default would leave a dead worker's
# leader hanging that long with every request in it.
HEARTBEAT_TIMEOUT_S = 15
REREAD_S = 0.05         # a worker's pause before it reads a rejected step's key again
LOG_EVERY_S = 10        # a worker logs rejected values at most this often
MAC_BYTES = hashlib.sha256().digest_size


@dataclass(frozen=True, slots=True)
class Cluster:
    coordinator_address: str   # HOST:PORT of process 0, where JAX's coordination service listens
    num_processes: int
    process_id: int
    secret: bytes | None = field(default=None, repr=False)   # JAXSERVE_CLUSTER_SECRET: every value is MACed with it

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
    if num == 1:
        return None
    secret = environ.get(SECRET_ENV) or None
    if secret is None and not is_loopback(host):
        raise ValueError(f"--coordinator-address {address} is reachable from other hosts, and whoever reaches it can "
                         f"publish steps: set {SECRET_ENV} to the same random value in every process (e.g. from "
                         "`openssl rand -hex 32`)")
    return Cluster(address, num, pid, secret and secret.encode())


def is_loopback(host: str) -> bool:
    """localhost or a loopback IP; any other name is not (it could resolve elsewhere)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    # The service listens on the address given (JAX's default is every interface, whatever the address says).
    jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes, cluster.process_id,
                               coordinator_bind_address=cluster.coordinator_address,
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


@dataclass(frozen=True, slots=True)
class Seal:
    """With the cluster secret: each value is prefixed with an HMAC-SHA256 over this run's process incarnations,
    its key and its payload, so it verifies only under the key, in the run, it was published for. No secret:
    values pass as they are (the format alone keeps code out)."""
    secret: bytes | None = field(default=None, repr=False)
    run: bytes = b""

    def seal(self, key: str, payload: bytes) -> bytes:
        return payload if self.secret is None else self._mac(key, payload) + payload

    def open(self, key: str, value: bytes) -> bytes:
        """value's payload; ValueError unless its MAC verifies."""
        if self.secret is None:
            return value
        mac, payload = value[:MAC_BYTES], value[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ValueError(f"its MAC does not verify: not the leader's, or {SECRET_ENV} differs from the leader's")
        return payload

    def _mac(self, key: str, payload: bytes) -> bytes:
        mac = hmac.new(self.secret, self.run + key.encode() + b"\0", hashlib.sha256)   # keys hold no NUL
        mac.update(payload)
        return mac.digest()


def sealing(cluster: Cluster, client) -> Seal:
    """The run's seal. Every process's incarnation (drawn afresh each time it joins) keys it too, so a value
    recorded from an earlier run with the same secret is refused. A barrier: every process calls it once."""
    if cluster.secret is None:
        return Seal()
    nodes = client.get_live_nodes(list(range(cluster.num_processes)))
    return Seal(cluster.secret, b"".join(nodes[i].to_bytes(8, "little") for i in range(cluster.num_processes)))


class StepPublisher:
    """The leader's side: each DeviceStep under the next step number, then STOP."""

    def __init__(self, client, seal: Seal):
        self.client, self.seal, self.step = client, seal, 0

    def publish(self, step) -> None:
        self._put(step_codec.encode(step))

    def stop(self) -> None:
        self._put(STOP)

    def _put(self, data: bytes) -> None:
        chunk, index = divmod(self.step, STEPS_PER_CHUNK)
        # Every worker is past the chunk before last: the leader syncs each model step's samples before it
        # publishes the step after next, and those samples need every process's shard of the step.
        if index == 0 and chunk >= 2:
            self.client.key_value_delete(f"jaxserve/steps/{chunk - 2}")
        key = step_key(self.step)
        # Overwrite: a value planted under the key first must not fail the publish (ALREADY_EXISTS); the workers
        # skip it until this one replaces it.
        self.client.key_value_set_bytes(key, self.seal.seal(key, data), allow_overwrite=True)
        self.step += 1


class StepReader:
    """A worker's side: step after step, each the first value under its key that verifies and decodes."""

    def __init__(self, client, seal: Seal, process_id: int):
        self.client, self.seal, self.process_id = client, seal, process_id
        self.step, self.unlogged, self.logged = 0, 0, float("-inf")

    def read(self):
        """The next DeviceStep; None for the stop message. A value that fails is not run: the key is read again
        (the leader's value overwrites a planted one) until one passes."""
        key = step_key(self.step)
        while True:
            value = wait_for(self.client, key)
            try:
                payload = self.seal.open(key, value)
                step = None if payload == STOP else step_codec.decode(payload)
            except ValueError as e:
                self.reject(key, e)
                time.sleep(REREAD_S)
                continue
            self.step += 1
            return step

    def reject(self, key: str, error: ValueError) -> None:
        if time.monotonic() - self.logged < LOG_EVERY_S:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more rejections since the last such line)" if self.unlogged else ""
        print(f"jaxserve: process {self.process_id}: rejected a value under {key}, not the leader's: {error}{more}",
              file=sys.stderr, flush=True)
        self.unlogged, self.logged = 0, time.monotonic()


@contextlib.contextmanager
def leading(cluster: Cluster | None, runner) -> Iterator[StepPublisher | None]:
    """On the leader (nothing to do without a cluster): each step `runner` launches inside the block is published
    first; after it, the stop message, then the cluster's shutdown, which waits for every worker to leave."""
    if cluster is None:
        yield None
        return
    client = coordination_client()
    publisher = StepPublisher(client, sealing(cluster, client))
    runner.observe_launches(publisher.publish)
    try:
        yield publisher
    finally:
        runner.observe_launches(None)
        publisher.stop()
        jax.distributed.shutdown()


def follow(cluster: Cluster, runner) -> int:
    """A worker's loop: launch each step the leader publishes, outputs dropped, until the stop message; then leave
    the cluster. The number of steps run. Steps in flight are bounded as on the leader: XLA:CPU deadlocks past 32
    multi-device programs in flight per device (tests/tp_worker.py)."""
    client, inflight = coordination_client(), deque()
    reader = StepReader(client, sealing(cluster, client), cluster.process_id)
    for steps in itertools.count():
        if (step := reader.read()) is None:
            break
        inflight.append(runner.launch(step))
        if len(inflight) > MAX_INFLIGHT_STEPS:
            jax.block_until_ready(inflight.popleft())
    jax.block_until_ready(list(inflight))
    jax.distributed.shutdown()
    return steps


def wait_for(client, key: str) -> bytes:
    """The value of key, however long the leader idles; any other error (the leader gone) raises."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, WAIT_MS)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
