"""`yuebing bench tenants`: a steady tenant's goodput alone, beside a tenant flooding
at several times capacity with the Conductor's fairness, and without it, on one
cluster in one run (yuebing/bench/tenants.py)."""

from __future__ import annotations

import argparse

from yuebing.commands import add_cluster_flags, add_json_flag, cluster_paths, write_json
from yuebing.flags import add_flags, from_args

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.tenants import TenantsSpec

    p = subparsers.add_parser("tenants", help="a steady tenant's goodput alone and beside one flooding, live")
    add_flags(p, TenantsSpec)
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench import tenants

    spec = from_args(tenants.TenantsSpec, args)
    model, work = cluster_paths(args, "tenants")
    print(f"steady at {spec.steady_rps:g} req/s, flood at {spec.flood_rps:g} req/s ({spec.flood_factor:g}× "
          f"{spec.capacity_rps:g}), {spec.seconds:g} s a phase; SLOs: TTFT {spec.slo_ttft_ms:g} ms, TBT "
          f"{spec.slo_tbt_ms:g} ms; logs in {work}", flush=True)
    results = tenants.run(spec, model, work, lambda text: print(text, flush=True))
    print("\ngoodput: requests within both SLOs per second of a phase")
    print(tenants.table(results))
    write_json(tenants.to_json(results, spec), args.json)
    return 0
