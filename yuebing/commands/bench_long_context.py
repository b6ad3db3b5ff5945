"""`yuebing bench long-context`: a prompt near the context limit on one prefill
instance against a CPP group, live, outputs checked against plain vLLM
(yuebing/bench/long_context.py)."""

from __future__ import annotations

import argparse

from yuebing.commands import add_json_flag, write_json
from yuebing.commands.bench_ttft import LIVE_ALIASES
from yuebing.flags import add_flags, from_args

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.long_context import LongContextBench

    p = subparsers.add_parser("long-context", help="TTFT of a prompt near the context limit: one prefill instance "
                                                   "vs a CPP group, live")
    add_flags(p, LongContextBench, LIVE_ALIASES)
    add_json_flag(p)
    # A prompt near the tiny model's 4,096-token limit, and fewer repeats than `bench ttft`'s.
    p.set_defaults(func=run, prompt_tokens=4000, repeats=5)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.long_context import LongContextBench, table
    from yuebing.bench.long_context import run as bench

    out = bench(from_args(LongContextBench, args, LIVE_ALIASES))
    print(table(out))
    write_json(out, args.json)
    return 0 if out["outputs_match"] else 1
