"""`yuebing bench reuse`: TTFT with part of the prompt already in the node pools, on
the same node or another (yuebing/bench/reuse.py)."""

from __future__ import annotations

import argparse

from yuebing.commands.bench_ttft import add_live_parser, run_live

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    help_text = "TTFT with 0/50/90 %% of the prompt cached locally, and 90 %% on another node"
    add_live_parser(subparsers, "reuse", help_text, repeats=7, run=run)


def run(args: argparse.Namespace) -> int:
    return run_live("reuse", args)
