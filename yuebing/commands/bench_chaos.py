"""`yuebing bench chaos`: kill and stall each process of a live `--nodes 2` cluster
under steady streaming load (yuebing/bench/chaos.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict

from yuebing.commands import add_cluster_flags, add_json_flag, cluster_paths, write_json

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.chaos import ACTIONS, TARGETS, ChaosSpec

    p = subparsers.add_parser("chaos", help="kill and stall each process under load: errors, hung requests, recovery")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS, help="processes to fault")
    p.add_argument("--actions", nargs="+", default=list(ACTIONS), choices=ACTIONS, help="kill (SIGKILL), stop (SIGSTOP)")
    p.add_argument("--concurrency", type=int, default=ChaosSpec.concurrency, help="clients streaming all the time")
    p.add_argument("--stall", type=float, default=ChaosSpec.stall_s, help="seconds a stopped process stays stopped")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances")
    p.add_argument("--decode", type=int, default=2, help="decode instances")
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.chaos import DEADLINE_S, HEADER, ChaosSpec, chaos, scenarios
    from yuebing.launcher import up_launcher

    model, work = cluster_paths(args, "chaos")
    spec = ChaosSpec(args.concurrency, args.stall)
    flags = ("--model", str(model), "--nodes", "2", "--prefill", str(args.prefill), "--decode", str(args.decode),
             "--request-timeout", str(DEADLINE_S))
    say = lambda text: print(text, flush=True)  # noqa: E731
    with up_launcher(work, "chaos", *flags) as (url, launcher):
        say(f"cluster up at {url} (logs in {work}); {HEADER}")
        outcomes = asyncio.run(chaos(url, model.name, launcher.pid, scenarios(tuple(args.targets),
                                                                               tuple(args.actions)), spec, say))
    write_json([asdict(o) for o in outcomes], args.json)
    bad = [o.scenario for o in outcomes if o.hung or o.recovery_s is None]
    if bad:
        print(f"hung requests or no recovery in: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
