"""`yuebing bench control-plane`: the gateway's, the Conductor's, NATS's and the
instances' CPU per request and per streamed token, on fake engines, with 1 and 2
gateways and Conductors (yuebing/bench/control_plane.py)."""

from __future__ import annotations

import argparse

from yuebing.commands import add_cluster_flags, add_json_flag, cluster_paths, write_json
from yuebing.flags import add_flags, from_args

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.control_plane import ControlPlaneBench

    p = subparsers.add_parser("control-plane", help="control-plane CPU per request and per token, engines faked")
    add_flags(p, ControlPlaneBench)
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.control_plane import ControlPlaneBench, against_vllm, comparison_table, floor, floor_line, table
    from yuebing.bench.control_plane import run as run_bench

    model, work = cluster_paths(args, "control-plane")
    spec = from_args(ControlPlaneBench, args)
    say = lambda text: print(text, flush=True)  # noqa: E731
    if spec.against_vllm:
        results = against_vllm(spec, model, work, say)
        print(comparison_table(results))
        if least := floor(results):
            print(floor_line(least))
    else:
        results = run_bench(spec, model, work, say)
        print(table(results))
    write_json(results, args.json)
    return 0 if all(r["errors"] == 0 for r in results) else 1
