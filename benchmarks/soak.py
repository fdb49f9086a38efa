"""Soak of `jaxserve serve`: many short requests, a share cancelled mid-stream, must leave the server as it was.

--num-requests calls, all sent at once under a cap on calls in flight (--concurrency): random token-id prompts
of 8-64 tokens (--prompt-len), max_tokens 4-32 (--max-tokens), half greedy and half sampled (temperature 1, top_p 0.9, top_k 50). A share
(--cancel-frac) is cancelled by the client after a random k-th streamed message, 1 <= k < max_tokens (such a
call that finishes before its k-th message simply completes). After --warmup-requests calls of the same mix,
the row records:
  hung_calls       calls that did not end within --call-timeout s (the client then cancels them);
  leaked_blocks    kv_blocks_used once ServerStats shows nothing running, waiting or pending (polled for up to
                   --idle-timeout s); stuck_requests: the running + waiting + pending left then;
  rss_*_mib        VmRSS of the server this script started and its engine process, after warm-up and after the
                   soak (None with --target);
  changed_outputs  fixed greedy probes, each sent alone before and after the soak (each phase with its own cache
                   salt, so both prefill in full), whose tokens differ or that failed;
  errors           calls that ended with another status than OK, by status code;
and the script exits 1 when hung_calls, leaked_blocks, stuck_requests or changed_outputs is nonzero.

  python benchmarks/soak.py --server-args "--max-num-seqs 16 --max-model-len 1024 --num-blocks 512"  # CPU, SmolLM2

Row (bench "soak"): benchmarks/results/soak_<backend>.json; ms = wall time of the soak, tok_s = output tokens
received (cancelled calls' included) / wall; TTFT and end-to-end latency of the calls that completed.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# serve_load first: it keeps this process off the server's GPU before jax loads
from benchmarks.serve_load import (DEFAULT_MAX_WAITING, HUNG, RequestResult, add_server_args,  # noqa: E402
                                   child_pids, percentiles, run_main, send, serving)
import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import write_rows  # noqa: E402
from jaxserve.client import Client, ServerStatsResponse, generate_request  # noqa: E402
from jaxserve.engine.sampling_params import SamplingParams  # noqa: E402
from jaxserve.serve import jaxserve_pb2 as pb  # noqa: E402

PROMPT_LEN = (8, 64)              # inclusive ranges, uniform
MAX_TOKENS = (4, 32)
GREEDY, SAMPLED = {"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
NUM_PROBES, PROBE_PROMPT_LEN = 4, 32
PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
IDLE_POLL_S = 0.2


@dataclass(slots=True)
class SoakCall:
    message: pb.GenerateRequest
    cancel_after: int             # streamed messages before the client cancels; 0: read to the end


def soak_call(rng: np.random.Generator, vocab: int, cancel_frac: float, prompt_len=PROMPT_LEN,
              max_tokens=MAX_TOKENS) -> SoakCall:
    prompt = rng.integers(0, vocab, rng.integers(prompt_len[0], prompt_len[1] + 1)).tolist()
    max_tokens = int(rng.integers(max_tokens[0], max_tokens[1] + 1))
    params = SamplingParams(max_tokens=max_tokens, **(SAMPLED if rng.random() < 0.5 else GREEDY))
    cancel_after = int(rng.integers(1, max_tokens)) if rng.random() < cancel_frac else 0
    return SoakCall(generate_request(prompt, params, 0, None), cancel_after)


def soak_calls(count: int, seed: int, vocab: int, args) -> list[SoakCall]:
    rng = np.random.default_rng(seed)
    return [soak_call(rng, vocab, args.cancel_frac, args.prompt_len, args.max_tokens) for _ in range(count)]


async def run_calls(client: Client, calls: list[SoakCall], args) -> tuple[float, list[RequestResult]]:
    """All calls at once, at most --concurrency in flight, each bounded by --call-timeout; wall s, results."""
    limit, start = asyncio.Semaphore(args.concurrency), time.perf_counter()
    results = await asyncio.gather(*(send(client, c.message, limit, c.cancel_after, args.call_timeout)
                                     for c in calls))
    return time.perf_counter() - start, results


async def probe_outputs(client: Client, prompts: list[list[int]], salt: str, timeout: float) -> list[list[int] | None]:
    """Each probe's tokens, sent one at a time; None where the call failed."""
    outputs = []
    for prompt in prompts:
        try:
            response = await client.complete(prompt, PROBE_PARAMS, cache_salt=salt, timeout=timeout)
            outputs.append(list(response.outputs[0].token_ids))
        except grpc.aio.AioRpcError as e:
            print(f"soak: probe failed ({salt}): {e.code().name}: {e.details()}", flush=True)
            outputs.append(None)
    return outputs


async def idle_stats(client: Client, timeout_s: float) -> ServerStatsResponse:
    """ServerStats once nothing runs, waits or pends, or the last seen after timeout_s."""
    deadline = time.monotonic() + timeout_s
    stats = await asyncio.wait_for(client.server_stats(), timeout_s)
    while (stats.running or stats.waiting or stats.pending) and time.monotonic() < deadline:
        await asyncio.sleep(IDLE_POLL_S)
        stats = await asyncio.wait_for(client.server_stats(), timeout_s)
    return stats


def rss_mib(proc: subprocess.Popen | None) -> float | None:
    """VmRSS of the server and its children (its engine process), summed."""
    if proc is None:
        return None
    kib = 0
    for pid in (proc.pid, *child_pids(proc.pid)):
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        kib += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
    return round(kib / 1024, 1)


def soak_row(args, model: str, wall: float, results: list[RequestResult], stats: ServerStatsResponse,
             rss_mib_before_after: tuple, changed_outputs: int) -> dict:
    ok = [r for r in results if r.ok]
    completed = [r for r in ok if not r.cancelled]
    errors = Counter(r.status for r in results if not r.ok)
    tokens = sum(r.output_tokens for r in ok)
    return {"bench": "soak", "impl": "jaxserve",
            "params": {"num_requests": args.num_requests, "concurrency": args.concurrency,
                       "cancel_frac": args.cancel_frac, "seed": args.seed, "call_timeout_s": args.call_timeout,
                       "prompt_len": list(args.prompt_len), "max_tokens": list(args.max_tokens),
                       "model": model, "config": args.config},
            "ms": wall * 1e3, "tok_s": tokens / wall, "requests": len(results), "cancels": len(ok) - len(completed),
            "completed": len(completed), "hung_calls": errors.pop(HUNG, 0), "errors": dict(errors),
            "leaked_blocks": stats.kv_blocks_used, "stuck_requests": stats.running + stats.waiting + stats.pending,
            "rss_before_mib": rss_mib_before_after[0], "rss_after_mib": rss_mib_before_after[1],
            "changed_outputs": changed_outputs, "output_tokens": tokens,
            **percentiles("ttft", [r.ttft for r in completed if r.output_tokens]),
            **percentiles("e2e", [r.e2e for r in completed])}


async def soak(args, target: str, proc: subprocess.Popen | None) -> dict:
    """Warm up, probe, soak, wait for idle, probe again: the row."""
    async with Client(target) as client:
        info = await client.model_info()
        vocab = info.vocab_size
        probes = np.random.default_rng(args.seed + 1).integers(0, vocab, (NUM_PROBES, PROBE_PROMPT_LEN)).tolist()
        await run_calls(client, soak_calls(args.warmup_requests, args.seed + 2, vocab, args), args)
        before = await probe_outputs(client, probes, "probe-before", args.call_timeout)
        rss_before = rss_mib(proc)
        wall, results = await run_calls(client, soak_calls(args.num_requests, args.seed, vocab, args), args)
        stats = await idle_stats(client, args.idle_timeout)
        rss_after = rss_mib(proc)
        after = await probe_outputs(client, probes, "probe-after", args.call_timeout)
    changed = sum(b is None or b != a for b, a in zip(before, after))
    return soak_row(args, info.model, wall, results, stats, (rss_before, rss_after), changed)


def print_row(row: dict) -> None:
    print(f"soak: {row['requests']} requests in {row['ms'] / 1e3:.1f} s ({row['tok_s']:.1f} out tok/s): "
          f"{row['completed']} completed, {row['cancels']} cancelled, errors {row['errors']}, "
          f"hung {row['hung_calls']} | leaked blocks {row['leaked_blocks']}, stuck requests {row['stuck_requests']} "
          f"| RSS {row['rss_before_mib']} -> {row['rss_after_mib']} MiB | changed outputs {row['changed_outputs']} "
          f"| TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms, e2e p99 {row['e2e_p99_ms']:.0f} ms",
          flush=True)


def failures(row: dict) -> list[str]:
    return [f"{k}={row[k]}" for k in ("hung_calls", "leaked_blocks", "stuck_requests", "changed_outputs") if row[k]]


def add_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32, help="most calls in flight")
    p.add_argument("--cancel-frac", type=float, default=0.2, help="share of calls the client cancels mid-stream")
    p.add_argument("--prompt-len", type=int, nargs=2, default=PROMPT_LEN, metavar=("LO", "HI"),
                   help="prompt tokens, uniform in [LO, HI]")
    p.add_argument("--max-tokens", type=int, nargs=2, default=MAX_TOKENS, metavar=("LO", "HI"),
                   help="max_tokens, uniform in [LO, HI]")
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--call-timeout", type=float, default=120.0, help="s a call may take before it counts as hung")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="s to wait for the server to drain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/soak_<backend>.json)")


def check_args(args) -> None:
    if args.num_requests < 1 or args.concurrency < 1 or args.warmup_requests < 0:
        raise ValueError("num_requests and concurrency must be >= 1, warmup_requests >= 0")
    if not 0 <= args.cancel_frac <= 1 or args.call_timeout <= 0 or args.idle_timeout <= 0:
        raise ValueError("cancel_frac must be in [0, 1], call_timeout and idle_timeout > 0")


def cmd_soak(args, command: str) -> None:
    check_args(args)
    with serving(args, max(DEFAULT_MAX_WAITING, args.concurrency)) as (target, proc):
        row = asyncio.run(soak(args, target, proc))
    print_row(row)
    # Only now touch this process's device: on a GPU machine the server had it to itself.
    write_rows(pathlib.Path(args.out or ROOT / f"benchmarks/results/soak_{jax.default_backend()}.json"), [row], command)
    if failures(row):
        sys.exit(f"soak: FAILED: {', '.join(failures(row))}")


def main(argv=None) -> None:
    run_main("soak", __doc__, add_args, cmd_soak, argv)


if __name__ == "__main__":
    main()
