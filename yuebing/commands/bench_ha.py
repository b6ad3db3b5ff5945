"""`yuebing bench ha`: the compose HA layout under load while servers crash, every role
restarts one replica at a time and decode scales from two to one (yuebing/bench/ha.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from yuebing.commands import add_json_flag, write_json

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.ha import STEPS

    names = [s.name for s in STEPS]
    p = subparsers.add_parser("ha", help="the compose HA layout under load: crashes, rolling restarts, scale-down")
    p.add_argument("--steps", nargs="+", type=int, metavar="N", help=f"which steps, by number (default all): "
                   + "; ".join(f"{i}: {n}" for i, n in enumerate(names)))
    p.add_argument("--clients", type=int, default=3, help="clients streaming all the time")
    p.add_argument("--port", type=int, default=8100, help="the load balancer's port on the host")
    p.add_argument("--work-dir", help="secrets and logs (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="leave the containers running afterwards")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.ha import HEADER, STEPS, drill, options_for
    from yuebing.compose import down, up

    say = lambda text: print(text, flush=True)  # noqa: E731
    steps = STEPS if args.steps is None else tuple(STEPS[i] for i in args.steps)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="yuebing-ha-"))
    work.mkdir(parents=True, exist_ok=True)
    options = options_for(work, args.port, say)
    try:
        env = up(options, work)
        say(HEADER)
        outcomes = asyncio.run(drill(options, env, steps, args.clients, say))
    finally:
        if not args.keep:
            down(options)
    write_json([asdict(o) for o in outcomes], args.json)
    bad = [o.step for o in outcomes if o.failed and not o.step.startswith("kill gateway") or o.unequal]
    if bad:
        print(f"requests failed in: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
