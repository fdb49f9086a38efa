"""Where an engine step's time goes, host against device, in steady decode: N prompts x input_len tokens, then
`--steps` decode steps timed half by half (the engine's async loop: launch step N+1, then finish step N).

  python benchmarks/step_timeline.py --config configs/llama3-8b-random.yaml --quantization fp8 \
      --set kv_cache_dtype=fp8
  python benchmarks/step_timeline.py --config configs/llama3-8b-random.yaml --shared-prefix-len 1024 \
      --input-len 64 --set cascade_attention=off      # a shared system prompt, cascade attention off

Prints the median per step of: schedule (scheduler), prepare (runner: block tables, inputs to the device), enqueue
(the compiled graphs' calls; of it, stage: the inputs sent and staged, sample: the sampler's call), wait (the host
blocked on the previous step's samples: the device is the bottleneck when it is large) and finish (samples ->
sequences, outputs). The period is what TPOT sees.
With --profile, each costly kernel XLA made is followed by the op it came from (the compiled model graphs' HLO
metadata: the model's named scopes and the JAX primitive). With --idle-launch, steps launched once the device has
finished the one before are timed too: an enqueue as long there is the host's own work, not a wait on the device.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import costliest, device_events, host_events  # noqa: E402
from benchmarks.offline import override  # noqa: E402

from jaxserve import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from jaxserve.config import QUANTIZATIONS  # noqa: E402
from jaxserve.engine.llm_engine import Launched  # noqa: E402
from jaxserve.models.loader import load_run  # noqa: E402

PHASES = ("schedule", "prepare", "enqueue", "wait", "finish", "period")
ENQUEUE_PARTS = ("stage", "sample")   # the inputs packed and sent, the sampler's call; the model graph's the rest


def timed_steps(engine, steps: int, idle_launch: bool = False) -> dict[str, list[float]]:
    """ms of each phase of `steps` async engine steps; idle_launch: each step launched once the device has finished
    the one before (its enqueue is then the host's own cost, with no wait on the device in it)."""
    times = {p: [] for p in PHASES + ENQUEUE_PARTS}
    runner, inflight, engine._inflight = engine.runner, engine._inflight, None
    prepare, run = runner.prepare_inputs, runner.run
    stage, sample = runner.buffers.stage, runner.buffers.sample
    clock = {}

    def timed(name, fn):
        def call(*args):
            start = time.perf_counter()
            result = fn(*args)
            clock[name] = time.perf_counter() - start
            return result
        return call
    runner.prepare_inputs, runner.run = timed("prepare", prepare), timed("enqueue", run)
    runner.buffers.stage, runner.buffers.sample = timed("stage", stage), timed("sample", sample)
    try:
        for _ in range(steps):
            if idle_launch and inflight is not None:
                jax.block_until_ready((inflight.out, engine.runner.kv_cache))
            t0 = time.perf_counter()
            output = engine.scheduler.schedule()
            t1 = time.perf_counter()
            launched = engine.runner.execute(output)
            t2 = time.perf_counter()
            if inflight is not None:
                jax.block_until_ready(inflight.out)
            t3 = time.perf_counter()
            engine.complete_step(inflight)
            t4 = time.perf_counter()
            inflight = None if launched is None else Launched(output.rows, launched)
            for name, ms in (("schedule", t1 - t0), ("prepare", clock.get("prepare", 0.0)),
                             ("enqueue", clock.get("enqueue", 0.0)), ("wait", t3 - t2), ("finish", t4 - t3),
                             ("period", t4 - t0), *((p, clock.get(p, 0.0)) for p in ENQUEUE_PARTS)):
                times[name].append(ms * 1e3)
    finally:
        runner.prepare_inputs, runner.run, engine._inflight = prepare, run, inflight
        runner.buffers.stage, runner.buffers.sample = stage, sample
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q], default=None)
    ap.add_argument("--set", nargs="+", default=[], metavar="KNOB=VALUE")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="random tokens every prompt starts with")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile 16 engine steps on the GPU: busy against idle, the N costliest kernels")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also trace 16 engine steps on the host: the N costliest host events a step, by thread")
    ap.add_argument("--idle-launch", action="store_true",
                    help="also time steps launched on an idle device: the graph calls' host cost alone")
    args = ap.parse_args(argv)
    loaded, cfg = load_run(None, args.config, quantization=args.quantization)
    llm = LLM(loaded, config=override(cfg, args.set))
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, loaded.config.vocab_size, args.shared_prefix_len).tolist()
    prompts = [prefix + rng.integers(0, loaded.config.vocab_size, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    # as many tokens as the model length leaves: rows that decode while the later prompts prefill must not finish
    # before the timed steps
    params = SamplingParams(temperature=0.0, max_tokens=llm.engine.cfg.max_model_len - len(prompts[0]), ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)   # as offline.py and LLM.generate
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params)
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()   # prefill every prompt first: the timed steps are decodes of all of them
    times = timed_steps(engine, args.steps)
    print(" ".join(f"{p} {np.median(times[p]):.2f} ms" for p in PHASES), flush=True)
    print("enqueue: " + " ".join(f"{p} {np.median(times[p]):.2f} ms" for p in ENQUEUE_PARTS), flush=True)
    if args.idle_launch:
        idle = timed_steps(engine, args.steps, idle_launch=True)
        print("launched on an idle device: " + " ".join(f"{p} {np.median(idle[p]):.2f} ms"
                                                        for p in ("enqueue",) + ENQUEUE_PARTS), flush=True)
    periods = []
    for _ in range(args.steps):   # the engine's own loop, for comparison with the period above
        start = time.perf_counter()
        engine.step()
        periods.append((time.perf_counter() - start) * 1e3)
    print(f"engine.step {np.median(periods):.2f} ms, cascade steps {engine.stats()['cascade_steps']}", flush=True)
    if args.profile:
        print_device_profile(engine, args.profile)
    if args.host_profile:
        print_host_profile(engine, args.host_profile)


def print_device_profile(engine, top: int, steps: int = 16) -> None:
    """Per engine step over `steps` steps: the GPU's busy time against the wall span, and the costliest kernels."""
    events = device_events(lambda: [engine.step() for _ in range(steps)], repeats=1)
    if not events:
        print("no GPU profile (no GPU or no CUPTI)")
        return
    span = (events[-1][0] + events[-1][1] - events[0][0]) / 1e6 / steps
    busy = sum(d for _, d, _ in events) / 1e6 / steps
    print(f"GPU per step: span {span:.2f} ms, busy {busy:.2f} ms, idle {span - busy:.2f} ms, "
          f"{len(events) / steps:.0f} launches", flush=True)
    sources = kernel_sources(engine)
    for name, ms, count in costliest(events, steps, top):
        print(f"    {ms:8.3f} ms x{count / steps:6.1f} {name[:100]}", flush=True)
        if name in sources:
            print(f"                      <- {sources[name]}", flush=True)


def print_host_profile(engine, top: int, steps: int = 16) -> None:
    """Per engine step over `steps` steps: the host trace events (the runtime's scopes, the driver's calls) that
    take the most time, each with its thread and count; a scope's time includes the events inside it."""
    totals: dict[tuple[str, str], list] = {}
    for thread, duration, name in host_events(lambda: [engine.step() for _ in range(steps)], repeats=1):
        entry = totals.setdefault((thread, name), [0.0, 0])
        entry[0] += duration / 1e6 / steps
        entry[1] += 1
    print("host events per step (ms, count, thread, name):", flush=True)
    for (thread, name), (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {ms:8.3f} ms x{count / steps:6.1f} [{thread[:24]}] {name[:90]}", flush=True)


def kernel_sources(engine) -> dict[str, str]:
    """Kernel name (an HLO instruction's, '.' and '-' as '_', as the profiler reports XLA's kernels) -> the op_name
    of its metadata in the compiled model graphs (the model's named scopes, then the JAX primitive); graphs whose
    text cannot be read (some executables loaded from disk) give none."""
    sources = {}
    for key, executable in engine.graphs.manager.executables.items():
        if key[0] != "model":
            continue
        try:
            text = executable.as_text() or ""
        except Exception:   # what a deserialized executable raises varies by jax version
            continue
        for name, op in re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', text, re.M):
            sources.setdefault(re.sub(r"[.\-]", "_", name), op[-90:])
    return sources


if __name__ == "__main__":
    main()
