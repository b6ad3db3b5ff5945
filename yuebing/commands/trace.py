"""`yuebing trace REQUEST_ID`: a request's timeline across the cluster's processes,
from a run folder's logs (yuebing/timeline.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trace", help="print a request's timeline across the cluster's processes, from its logs")
    p.add_argument("request_id", help="the request's id: its response's x-yuebing-request-id header")
    p.add_argument("--run-dir", type=Path, required=True, help="the run folder `yuebing up` logs to (it prints it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.timeline import entries, render

    print(render(entries(args.run_dir, args.request_id), args.request_id))
    return 0
