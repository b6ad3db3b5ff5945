"""`yuebing bench conductor`: the Conductor's decisions per second and their latency
(yuebing/bench/conductor.py)."""

from __future__ import annotations

import argparse

from services.conductor.policy import ADMISSIONS, PREFILL_POLICIES
from yuebing.bench.conductor import ConductorBench, table
from yuebing.bench.conductor import run as run_bench
from yuebing.commands import add_json_flag, write_json
from yuebing.flags import Alias, add_flags, from_args

GROUP = "bench"
ALIASES = {
    "indexed_blocks": Alias("blocks"),
    "policy": Alias(choices=tuple(PREFILL_POLICIES)),
    "admission": Alias(choices=ADMISSIONS),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("conductor", help="Conductor decisions per second and latency")
    add_flags(p, ConductorBench, ALIASES)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = run_bench(from_args(ConductorBench, args, ALIASES))
    print(table(result))
    write_json(result, args.json)
    return 0
