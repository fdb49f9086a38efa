"""Start-up time: model creation, then engine construction with every graph compiled (cold: an empty persistent
cache), then the same in a fresh process with the cache warm. One row per phase and start.

  python benchmarks/startup.py --config configs/llama3-8b-random.yaml           # one H100 (the committed rows)
  python benchmarks/startup.py --config configs/smollm2-135m-instruct.yaml      # CPU
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_start(config: str, cache_dir: str) -> dict:
    """This process: load the model, build the engine (precompiling every graph); seconds of each."""
    from dataclasses import replace

    import jax

    from jaxserve import LLMEngine
    from jaxserve.models.loader import load_run
    start = time.perf_counter()
    loaded, cfg = load_run(None, config)
    jax.block_until_ready(jax.tree.leaves(loaded.model))
    created = time.perf_counter()
    engine = LLMEngine(loaded, replace(cfg, compile_cache_dir=cache_dir))
    ready = time.perf_counter()
    stats = engine.stats()
    return {"model_s": created - start, "engine_s": ready - created, "total_s": ready - start,
            "compiled_graphs": stats["compiled_graphs"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/startup_<backend>.json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # cache dir: run one start, print JSON
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_start(args.config, args.child)), flush=True)
        return
    import shlex

    from benchmarks.common import device_name, write_rows
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--config", args.config, "--child", cache],
                                 capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{start}: model {res['model_s']:.1f} s, engine (every graph) {res['engine_s']:.1f} s, "
                  f"total {res['total_s']:.1f} s, {res['compiled_graphs']} graphs", file=sys.stderr, flush=True)
            rows.append({"bench": "startup", "impl": "jaxserve", "params": {"config": args.config, "start": start},
                         "ms": res["total_s"] * 1e3, **{k: v for k, v in res.items() if k != "device"}})
    backend = "h100" if "H100" in device_name() else "cpu"
    write_rows(args.out or ROOT / "benchmarks" / "results" / f"startup_{backend}.json", rows,
               shlex.join(["python", "benchmarks/startup.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
