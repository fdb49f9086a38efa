"""Builders the test modules share."""
import asyncio
import contextlib
import threading
import time

from jaxserve import LLMEngine
from jaxserve.serve.server import ServeOptions, Server

MODEL = "smollm2-135m-instruct"
IDLE_TIMEOUT_S = 60


@contextlib.contextmanager
def in_process(engine: LLMEngine, **opts):
    """A Server with an HTTP port on an event loop of its own thread (as `jaxserve serve` runs it)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731

    async def start():
        server = Server([engine], ServeOptions(port=0, metrics_port=None, http_port=0, grace_period_s=1.0, **opts),
                        MODEL)
        await server.start()
        return server

    server = call(start())
    try:
        yield server
    finally:
        call(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def base_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def wait_idle(server: Server) -> dict:
    """Stats once nothing runs, waits or holds KV blocks (or the last seen, after IDLE_TIMEOUT_S)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        s = server.engine_loop.stats()
        if not (s["running"] or s["waiting"] or s["pending"] or s["kv_blocks_used"]) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)
