"""Start-up time: model creation, then engine construction with every graph compiled (cold: empty caches), then
the same in a fresh process with the caches warm (on GPU the executables load from disk: no tracing). One row
per start; each start then generates a few greedy tokens, and the warm start must give the cold one's.
A priming process first does what `scripts/setup.sh` does at install (its time: `prime_s`): it builds the CUDA custom
calls (nvcc, once per machine; ~40 s of whichever start came first on a fresh H100 machine when they were built on
first use) and runs one tiny jitted op.

  python benchmarks/startup.py --config configs/llama3-8b-random.yaml           # one H100 (the committed rows)
  python benchmarks/startup.py --config configs/smollm2-135m-instruct.yaml      # CPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


STATS = ("compiled_graphs", "graphs_from_cache", "compiles_after_start", "compile_timings")


def one_start(config: str, cache_dir: str) -> dict:
    """This process: load the model, build the engine (precompiling every graph); seconds of each."""
    from dataclasses import replace

    import jax

    from jaxserve import LLMEngine
    from jaxserve.compilation_cache import enable_compilation_cache
    from jaxserve.models.loader import load_run
    start = time.perf_counter()
    enable_compilation_cache(cache_dir)   # before load_run sets the config's
    loaded, cfg = load_run(None, config)
    jax.block_until_ready(jax.tree.leaves(loaded.model))
    created = time.perf_counter()
    engine = LLMEngine(loaded, replace(cfg, compile_cache_dir=cache_dir))
    ready = time.perf_counter()
    return {"model_s": created - start, "engine_s": ready - created, "total_s": ready - start,
            "tokens": first_tokens(engine), **{k: engine.stats()[k] for k in STATS}}


def breakdown(t: dict) -> str:
    """The engine's compile_timings in one line: its phases, the main thread's time, the pool's, each graph kind
    (compiled count, summed compile seconds, tracing seconds, executables loaded)."""
    kinds = ", ".join(f"{kind} {k['compiled']}x {k['compile_s']:.1f} s (trace {k['trace_s']:.1f} s, "
                      f"{k['loaded']} loaded)" for kind, k in t["kinds"].items())
    return (f"peak phase {t.get('peak_s', 0):.1f} s, precompile {t.get('precompile_s', 0):.1f} s | main thread: "
            f"tracing {t['trace_s']:.1f} s, waiting {t['wait_s']:.1f} s | compiling {t['compile_wall_s']:.1f} s "
            f"wall, {t['compile_s']:.1f} s summed on {t['threads']} threads | {kinds}")


def first_tokens(engine) -> list[list[int]]:
    """A few greedy tokens after start: a warm start (graphs from the caches) must give the cold start's."""
    from jaxserve import SamplingParams
    ids = [engine.add_request([1 + i, 2, 3, 4] * 8, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
           for i in range(4)]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [list(done[i]) for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/startup_<backend>.json)")
    p.add_argument("--cache-dir", default=None, help="the caches' directory (default: a fresh temporary one); "
                   "must be empty for the cold start to be cold — later runs then find it warm")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # cache dir: run one start, print JSON
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_start(args.config, args.child)), flush=True)
        return
    import shlex

    from benchmarks.common import device_name, write_rows
    rows = []
    with (contextlib.nullcontext(args.cache_dir) if args.cache_dir else tempfile.TemporaryDirectory()) as cache:
        prime = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import custom_calls, jax; custom_calls.available(); "
                        "jax.jit(lambda x: x + 1)(1).block_until_ready()"],
                       check=True)
        prime_s = time.perf_counter() - prime
        for start in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--config", args.config, "--child", cache],
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{start}: model {res['model_s']:.1f} s, engine (every graph) {res['engine_s']:.1f} s, "
                  f"total {res['total_s']:.1f} s, {res['compiled_graphs']} graphs "
                  f"({res['graphs_from_cache']} executables from disk)\n  {breakdown(res['compile_timings'])}",
                  file=sys.stderr, flush=True)
            rows.append({"bench": "startup", "impl": "jaxserve", "params": {"config": args.config, "start": start},
                         "ms": res["total_s"] * 1e3, "prime_s": prime_s,
                         **{k: v for k, v in res.items() if k != "device"}})
    if rows[0]["tokens"] != rows[1]["tokens"]:
        raise SystemExit(f"warm start generated other tokens than the cold one: {rows[0]['tokens']} vs {rows[1]['tokens']}")
    backend = "h100" if "H100" in device_name() else "cpu"
    write_rows(args.out or ROOT / "benchmarks" / "results" / f"startup_{backend}.json", rows,
               shlex.join(["python", "benchmarks/startup.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
