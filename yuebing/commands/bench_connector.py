"""`yuebing bench connector`: what the KV connector's saves and loads cost a forward,
on the real copy machinery, without vLLM (yuebing/bench/connector.py)."""

from __future__ import annotations

import argparse

from yuebing.bench.connector_config import ConnectorBench
from yuebing.commands import add_json_flag, write_json
from yuebing.flags import Alias, add_flags, from_args

GROUP = "bench"
ALIASES = {"device": Alias(choices=("auto", "cpu", "cuda")),
           "model_shape": Alias(choices=("auto", "tiny", "llama3-8b"))}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("connector", help="KV saves and loads against the forward, without vLLM (CPU or GPU)")
    add_flags(p, ConnectorBench, ALIASES)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.connector import run as run_bench  # torch: only when the bench runs
    from yuebing.bench.connector import table

    result = run_bench(from_args(ConnectorBench, args, ALIASES))
    print(table(result))
    write_json(result, args.json)
    return 0
