"""`yuebing bench ttft`: a long prompt's TTFT on plain vLLM against the disaggregated
cluster, KV streaming on and off (yuebing/bench/ttft.py).

Also the flags and the running of every `LiveBench` (`bench reuse` uses them)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from yuebing.bench.ttft import LiveBench
from yuebing.commands import add_json_flag, write_json
from yuebing.flags import Alias, add_flags, from_args

GROUP = "bench"
LIVE_ALIASES = {"model": Alias(path=True)}


def add_live_parser(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, repeats: int, run: Callable[..., int],
) -> None:
    """`bench NAME` with the flags of a `LiveBench` (the benchmarks differ in how often they repeat)."""
    p = subparsers.add_parser(name, help=help_text)
    add_flags(p, LiveBench, LIVE_ALIASES)
    add_json_flag(p)
    p.set_defaults(func=run, repeats=repeats)


def run_live(name: str, args: argparse.Namespace) -> int:
    """Run yuebing/bench/NAME.py on the flags' `LiveBench`; print its table."""
    bench = importlib.import_module(f"yuebing.bench.{name}")  # imported here: it needs aiohttp and more
    spec = from_args(LiveBench, args, LIVE_ALIASES)
    results = bench.run(spec)
    print(bench.table(results, spec.prompt_tokens))
    write_json(bench.to_json(results, spec.prompt_tokens), args.json)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    help_text = "TTFT of a long prompt: colocated vLLM vs disaggregated, streaming on/off"
    add_live_parser(subparsers, "ttft", help_text, repeats=11, run=run)


def run(args: argparse.Namespace) -> int:
    return run_live("ttft", args)
