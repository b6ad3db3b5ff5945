"""`yuebing docs`: write the generated reference pages (yuebing/reference.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("docs", help="write the docs' reference pages (configuration, command, HTTP API) "
                              "from the code")
    p.add_argument("--out", type=Path, help="folder to write them to (default: docs/reference in this checkout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.reference import REFERENCE_DIR, write

    for path in write(args.out or REFERENCE_DIR):
        print(f"wrote {path}")
    return 0
