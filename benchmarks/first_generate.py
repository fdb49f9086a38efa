"""A first `jaxserve generate` on a warm machine: wall seconds of a fresh process (start, load, engine, answer),
this tree against other checkouts (`--tree PATH`, e.g. after `git worktree add /tmp/base COMMIT`), interleaved.
Each tree runs once first (its caches filled: the warm machine), then `--repeats` rounds of every tree.

  .venv/bin/python benchmarks/first_generate.py --tree /tmp/base   # rows in benchmarks/results/first_generate_cpu.json
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import write_rows  # noqa: E402


def generate_s(tree: pathlib.Path, prompt: str, max_tokens: int) -> float:
    """Wall seconds of `python -m jaxserve.cli generate` run from tree (its own jaxserve package), greedy."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "--temperature", "0", "--max-tokens",
                    str(max_tokens), prompt], cwd=tree, check=True, capture_output=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return time.perf_counter() - start


def tree_name(tree: pathlib.Path) -> str:
    if tree == ROOT:
        return "jaxserve"
    sha = subprocess.check_output(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], text=True).strip()
    return f"jaxserve@{sha}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to time beside this one")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/first_generate_cpu.json")
    args = ap.parse_args(argv)
    trees = [ROOT, *(pathlib.Path(t).resolve() for t in args.tree)]
    warm_up = {tree: generate_s(tree, args.prompt, args.max_tokens) for tree in trees}
    runs = {tree: [] for tree in trees}
    for r in range(args.repeats):
        for tree in trees:
            runs[tree].append(generate_s(tree, args.prompt, args.max_tokens))
        print(f"round {r}: " + ", ".join(f"{tree_name(t)} {rs[-1]:.2f} s" for t, rs in runs.items()), flush=True)
    params = {"max_tokens": args.max_tokens, "prompt": args.prompt, "threads": os.cpu_count()}
    rows = [{"bench": "first_generate", "impl": tree_name(tree), "params": params,
             "ms": float(np.median(rs)) * 1e3, "runs_s": rs, "warm_up_s": warm_up[tree]} for tree, rs in runs.items()]
    for row in rows:
        print(f"{row['impl']}: median {row['ms'] / 1e3:.2f} s over {args.repeats} (runs {row['runs_s']})")
    write_rows(args.out, rows, "python benchmarks/first_generate.py " + " ".join(argv or sys.argv[1:]))


if __name__ == "__main__":
    main()
