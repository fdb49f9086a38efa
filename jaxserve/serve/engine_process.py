"""The engines in a process of their own, as `jaxserve serve` runs them: its front ends (the event loop, gRPC's
poller, the tokenizer thread) and its engine threads then never share a GIL, which had slowed every engine step
under load (a step's host work waited for the front ends' Python, and gRPC's per-message poller made it worse).

The parent holds a RemoteReplica per engine, which EngineLoop routes to as to a Replica in its own process:
commands go down a pipe; each engine step comes back as one message with the replica's stats and its outputs as
deltas (the tokens, text and logprobs new since the request's last output; a cumulative output of 256 requests is
~0.5 MB to pickle every step), rebuilt into cumulative RequestOutputs on the event loop. The child ignores SIGINT
(the parent drains, then stops it) and stops its engines when the pipe closes (the parent died)."""
from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable

from tqdm import tqdm

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sequence import CompletionOutput, RequestOutput
from jaxserve.engine.structured_outputs import StructuredOutputs
from jaxserve.serve.engine_loop import STOP, EngineFailed, EngineFacts, EngineLoop, Replica


STOP_WAIT_S = 10   # for a starting engine process to end on SIGTERM, before SIGKILL


def spawn_uninterrupted(process) -> bool:
    """process.start() with a Ctrl-C held until it returns (whether one came): interrupted inside it, the child
    could be left running, unknown to the parent, holding its terminal. Only the main thread handles signals."""
    if threading.current_thread() is not threading.main_thread():
        process.start()
        return False
    interrupts = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupts.append(True))
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    return bool(interrupts)


class EngineProcess:
    """Starts the engine process, `build()` making its engines there, and waits until they are up."""

    def __init__(self, build: Callable[[], list[LLMEngine]]):
        context = multiprocessing.get_context("spawn")   # JAX's runtime does not survive a fork
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=run_engines, args=(child_conn, build), name="jaxserve-engines",
                                       daemon=True)
        interrupted = spawn_uninterrupted(self.process)
        child_conn.close()
        self.facts, snapshots = self._started(interrupted)
        self.grammars = StructuredOutputs(self.facts.tokenizer, self.facts.model_config.vocab_size,
                                          self.facts.eos_token_ids)   # checks requests' constraints
        self.replicas = [RemoteReplica(i, self, snapshot) for i, snapshot in enumerate(snapshots)]
        self.outputs: dict[str, RequestOutput] = {}   # each open request's latest, which deltas extend
        self.router: EngineLoop | None = None
        self.stopped = threading.Event()

    def _started(self, interrupted: bool) -> tuple[EngineFacts, list[dict]]:
        try:
            if interrupted:
                raise KeyboardInterrupt
            while not self.conn.poll(0.2):   # a Ctrl-C another thread took would not wake a blocking recv
                pass
            message = self.conn.recv()
        except KeyboardInterrupt:   # Ctrl-C while the engines start: the process goes too
            self.process.terminate()
            self.process.join(STOP_WAIT_S)
            if self.process.is_alive():   # SIGTERM ignored (a disposition inherited from its parent)
                self.process.kill()
                self.process.join()
            raise
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting; "
                               "its output above says why") from None
        if message[0] == "start_failed":
            self.process.join()
            raise message[1]
        return message[1], message[2]

    def attach(self, router: EngineLoop) -> None:
        """From now on the engines' messages are read on the router's event loop."""
        self.router = router
        router.loop.add_reader(self.conn.fileno(), self._receive)

    def send(self, index: int, command) -> None:
        self.conn.send((index, command))

    def forget(self, request_id: str) -> None:
        self.outputs.pop(request_id, None)

    def _receive(self) -> None:
        try:
            while self.conn.poll():
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _handle(self, message: tuple) -> None:
        router = self.router
        match message:
            case ("step", index, snapshot, deltas):
                self.replicas[index].snapshot = snapshot
                outputs = [out for delta in deltas if (out := self._rebuild(delta)) is not None]
                if outputs:
                    router._dispatch(outputs)
            case ("refused", request_id, error):
                router._deliver_error(request_id, error)
            case ("failed", index, error):
                router.loop.create_task(router._fail(self.replicas[index], error))
            case ("stopped",):
                self._close()

    def _rebuild(self, delta: tuple) -> RequestOutput | None:
        """The delta's request's cumulative output; None for a request whose call already ended."""
        request_id, finished = delta[0], delta[1]
        if request_id not in self.router.streams:
            self.outputs.pop(request_id, None)
            return None
        out = rebuilt(self.outputs.get(request_id), delta)
        if finished:
            self.outputs.pop(request_id, None)
        else:
            self.outputs[request_id] = out
        return out

    def _lost(self) -> None:
        """The pipe closed without a goodbye: the process died. Every replica fails."""
        self._close()
        self.process.join(5)
        code = self.process.exitcode
        error = EngineFailed(f"engine failed: the engine process exited (code {code})")
        for replica in self.replicas:
            if replica.failure is None:
                self.router.loop.create_task(self.router._fail(replica, error))

    def _close(self) -> None:
        if not self.stopped.is_set():
            self.router.loop.remove_reader(self.conn.fileno())
            self.stopped.set()

    def join(self) -> None:
        """After every replica was told to stop: their threads' end, then the process's."""
        self.stopped.wait()
        self.process.join()


class RemoteReplica:
    """An engine of the engine process, as EngineLoop routes to it: commands go down the pipe, its stats and
    failure come back."""

    def __init__(self, index: int, process: EngineProcess, snapshot: dict):
        self.index, self.process, self.snapshot = index, process, snapshot
        self.commands = self   # commands.put(command), as a Replica's queue takes them
        self.failure: EngineFailed | None = None
        self.num_open = 0

    def put(self, command) -> None:
        try:
            self.process.send(self.index, command)
        except OSError:   # the process is gone: its loss fails this replica already
            pass


# ---- outputs as deltas ----------------------------------------------------------------------------------------------
class DeltaEncoder:
    """Outputs as deltas against what was sent of each request: (request_id, finished, metrics, prompt, completions),
    the prompt's part (text, token ids, prompt logprobs) only in a request's first. Tokens and logprobs only grow;
    text may be cut back (a stop string's start held back, then dropped), so it is compared."""

    def __init__(self):
        self.sent: dict[str, dict[int, tuple[str, int]]] = {}   # per request, per completion: text, tokens

    def delta(self, out: RequestOutput) -> tuple:
        first = out.request_id not in self.sent
        sent = self.sent.setdefault(out.request_id, {})
        completions = [completion_delta(c, sent) for c in out.outputs]
        if out.finished:
            del self.sent[out.request_id]
        prompt = (out.prompt, out.prompt_token_ids, out.prompt_logprobs) if first else None
        return out.request_id, out.finished, out.metrics, prompt, completions

    def forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)


def completion_delta(c: CompletionOutput, sent: dict[int, tuple[str, int]]) -> tuple:
    """(index, text kept, text after, tokens kept, tokens after, cumulative logprob, logprobs after, finish and stop
    reasons); logprobs are cut at the tokens' count (the engine's list runs ahead)."""
    text, kept = sent.get(c.index, ("", 0))
    text_kept, num = len(text) if c.text.startswith(text) else 0, len(c.token_ids)
    kept = min(kept, num)
    sent[c.index] = (c.text, num)
    return (c.index, text_kept, c.text[text_kept:], kept, c.token_ids[kept:], c.cumulative_logprob,
            None if c.logprobs is None else c.logprobs[kept:num], c.finish_reason, c.stop_reason)


def rebuilt(last: RequestOutput | None, delta: tuple) -> RequestOutput:
    """The cumulative output a delta makes of the request's last one (None before its first)."""
    request_id, finished, metrics, prompt, completions = delta
    if prompt is not None:
        last = RequestOutput(request_id, prompt[0], prompt[1], [], False, prompt[2])
    before = {c.index: c for c in last.outputs}
    return RequestOutput(request_id, last.prompt, last.prompt_token_ids,
                         [extended(before.get(c[0]), *c) for c in completions], finished, last.prompt_logprobs,
                         metrics)


def extended(before: CompletionOutput | None, index: int, text_kept: int, text: str, kept: int, token_ids: list[int],
             cumulative_logprob, logprobs: list | None, finish_reason, stop_reason) -> CompletionOutput:
    if before is None:
        before = CompletionOutput(index, "", [], None, None)
    return CompletionOutput(index, before.text[:text_kept] + text, before.token_ids[:kept] + token_ids,
                            cumulative_logprob, None if logprobs is None else (before.logprobs or [])[:kept] + logprobs,
                            finish_reason, stop_reason)


# ---- the engine process ---------------------------------------------------------------------------------------------
def run_engines(conn, build: Callable[[], list[LLMEngine]]) -> None:
    """The engine process's main: build the engines, say so, then route the parent's commands to their threads until
    each was told to stop (or the parent is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole process group: the parent drains first
    tqdm.set_lock(threading.RLock())   # not tqdm's multiprocessing lock, which a process stopped while starting leaks
    try:
        engines = build()
    except BaseException as e:
        conn.send(("start_failed", picklable(e)))
        return
    sink = PipeSink(conn)
    replicas = [Replica(i, engine, sink) for i, engine in enumerate(engines)]
    conn.send(("ready", EngineFacts.of(engines[0]), [r.snapshot for r in replicas]))
    for replica in replicas:
        replica.thread.start()
    running = set(range(len(replicas)))
    while running:
        try:
            index, command = conn.recv()
        except (EOFError, OSError):
            for i in running:
                replicas[i].commands.put(STOP)
            break
        if command is STOP:
            running.discard(index)
        elif command[0] == "add" and not compiled(engines[index], command[1], command[2], sink):
            continue
        replicas[index].commands.put(command)
    for replica in replicas:
        replica.thread.join()
    sink.close()


def compiled(engine: LLMEngine, request_id: str, submission, sink: PipeSink) -> bool:
    """A request's structured-outputs constraint compiled here, before its engine thread takes it (the parent
    checked it); False, and the request refused, if it is invalid all the same."""
    spec = submission.params.structured_outputs
    try:
        if spec is not None:
            engine.compile_grammar(spec)
        return True
    except ValueError as e:
        sink.refused(request_id, e)
        return False


def picklable(error: BaseException) -> BaseException:
    """error, or a RuntimeError saying it where it would not arrive whole."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class PipeSink:
    """The replicas' sink in the engine process: a step's outputs become deltas on its engine thread (the lists they
    come from keep growing), a thread of their own pickles and sends them."""

    def __init__(self, conn):
        self.conn, self.encoder = conn, DeltaEncoder()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.last_snapshots: dict[int, dict] = {}
        self.thread = threading.Thread(target=self._send, name="jaxserve-engine-pipe", daemon=True)
        self.thread.start()

    def stepped(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        if outputs or replica.snapshot != self.last_snapshots.get(replica.index):
            self.last_snapshots[replica.index] = replica.snapshot
            self.queue.put(("step", replica.index, replica.snapshot, [self.encoder.delta(out) for out in outputs]))

    def refused(self, request_id: str, error: Exception) -> None:
        self.queue.put(("refused", request_id, picklable(error)))

    def aborted(self, request_id: str) -> None:
        self.encoder.forget(request_id)

    def failed(self, replica: Replica, error: EngineFailed) -> None:
        self.queue.put(("failed", replica.index, error))

    def close(self) -> None:
        self.queue.put(("stopped",))
        self.thread.join()

    def _send(self) -> None:
        while True:
            message = self.queue.get()
            try:
                self.conn.send(message)
            except (OSError, ValueError):   # the parent is gone
                return
            if message[0] == "stopped":
                return
