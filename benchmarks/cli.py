"""`jaxserve bench ...`: benchmarks reachable from the command line (registered by jaxserve.cli when importable)."""
from __future__ import annotations

import argparse

from benchmarks import sweep


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (results in benchmarks/results/)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("sweep", help="compile and time the jitted step of every bucket; weigh the bucket ladder",
                       description=sweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_args(p)
    p.set_defaults(func=sweep.cmd_sweep)
