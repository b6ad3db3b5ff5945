"""`yuebing bench hash`: the block hash's cost, sha256 against xxh3-128, and its share
of the gateway's per-request work (yuebing/bench/hash.py)."""

from __future__ import annotations

import argparse

from yuebing.bench.hash import HashBench, table
from yuebing.bench.hash import run as run_bench
from yuebing.commands import add_json_flag, write_json
from yuebing.flags import Alias, add_flags, from_args
from yuebing.model import default_model_dir

GROUP = "bench"
# The tokenizer of the model `yuebing up` serves by default (`yuebing model init`).
ALIASES = {"tokenizer": Alias(path=True, default=str(default_model_dir()))}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("hash", help="block hash cost: sha256 vs xxh3-128, against the gateway's work")
    add_flags(p, HashBench, ALIASES)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = run_bench(from_args(HashBench, args, ALIASES))
    print(table(result))
    write_json(result, args.json)
    return 0
