"""`yuebing sim-fleet`: the Conductor's own code at fleet scale, in the simulator.

The conversation trace's users multiplied with the fleet (`tiled`: each copy its own
prompts, arriving interleaved), so that every size carries the same load per
instance: how the decision's wall time, the prefix index and the books grow from 16
to 1,024 instances, whether pulling hot blocks (kvcentric) still pays over local
caches alone (cache_aware), and how fast the simulator itself runs. Up to
--exact-up-to instances each run is repeated with every instance scored
(`--shortlist 0`), the placement the shortlist must match."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from yuebing.commands import add_json_flag, text_table, write_json
from yuebing.lab import data

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-fleet", help="the Conductor's code on 16 to 1,024 simulated instances: decision "
                              "time, index and books, replication, placement against every instance scored")
    p.add_argument("--profile", default=str(data.GPU_PROFILE), help="timing profile (default: an H100's, shipped)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 128, 512, 1024],
                   help="fleets: prefill plus decode instances, half each; multiples of --base")
    p.add_argument("--base", type=int, default=16, help="the fleet that serves one copy of the trace")
    p.add_argument("--limit", type=int, default=3000, help="requests of the conversation trace per copy (its first N)")
    p.add_argument("--speed", type=float, default=4.0, help="replay speed of each copy")
    p.add_argument("--policies", default="kvcentric,cache_aware", help="prefill policies, comma-separated")
    p.add_argument("--shortlist", type=int, default=None, help="instances scored per role beyond the prefix holders "
                   "(default: the Conductor's)")
    p.add_argument("--exact-up-to", type=int, default=64,
                   help="fleets up to this size run again with every instance scored (0: none)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, s")
    p.add_argument("--slo-tbt", type=float, default=0.1, help="TBT SLO, s")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.predictor import load_predictor
    from yuebing.lab.sim_config import SimConfig
    from yuebing.lab.trace import load_trace

    if any(n < args.base or n % args.base for n in args.sizes) or args.base < 2 or args.base % 2:
        raise ValueError("--sizes: each a multiple of --base, itself even (half prefill, half decode)")
    predictor = load_predictor(args.profile, None)
    trace = load_trace(data.CONVERSATION_TRACE, args.limit)
    base = SimConfig(speed=args.speed, admission="predictive", slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt,
                     learn_decode_time=True)
    if args.shortlist is not None:
        base = replace(base, shortlist=args.shortlist)
    rows = [row for n in args.sizes for policy in args.policies.split(",")
            for row in _runs(trace, replace(base, policy=policy), n, args, predictor)]
    print(_table(rows, args))
    write_json({"config": vars(args) | {"func": None}, "runs": rows}, args.json)
    return 0


def _runs(trace, config, n: int, args: argparse.Namespace, predictor) -> list[dict]:
    """One fleet of n, with the shortlist and (small fleets) with every instance scored."""
    from yuebing.lab.sim import simulate
    from yuebing.lab.trace import tiled

    fleet = replace(config, prefill=n // 2, decode=n // 2)
    scaled = tiled(trace, n // args.base)
    shortlists = [fleet.shortlist, 0] if n <= args.exact_up_to and fleet.shortlist else [fleet.shortlist]
    rows = []
    for k in shortlists:
        sim = simulate(scaled, replace(fleet, shortlist=k), predictor, progress=True)
        rows.append(_row(sim, n, k, len(scaled)))
    if len(rows) == 2:
        short, exact = rows
        for key in ("goodput_rps", "ttft_mean_s"):
            short[f"{key}_vs_exact"] = short[key] / exact[key] if exact[key] else 0.0
    return rows


def _row(sim, n: int, shortlist: int, requests: int) -> dict:
    r = sim.result
    replicas = r["replicas"]
    return {"instances": n, "policy": r["policy"], "shortlist": shortlist, "requests": requests,
            "goodput_rps": r["goodput_rps"], "ttft_mean_s": r["ttft_s"]["mean"], "slo_attainment": r["slo_attainment"],
            "decision_us": r["decision_us"], "indexed_blocks": replicas["blocks"],
            "index_entries": round(replicas["blocks"] * replicas["mean"]), "replicas_mean": replicas["mean"],
            "hit_rate_local": r["hit_rate_local"], "hit_rate_global": r["hit_rate_global"],
            "simulated_requests_per_s": r["simulated_requests_per_s"], "rss_mib": _rss_mib()}


def _rss_mib() -> float:
    """This process's resident memory now (Linux), MiB: the index and books of the run
    just finished are still held."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    header = ["instances", "policy", "scored", "requests", "goodput/s", "vs all", "TTFT mean s", "vs all",
              "decision µs", "p99", "indexed", "entries", "hit local", "hit global", "sim req/s", "RSS MiB"]
    body = []
    for r in rows:
        d = r["decision_us"]
        body.append([str(r["instances"]), r["policy"], f"{r['shortlist']}" if r["shortlist"] else "all",
                     str(r["requests"]), f"{r['goodput_rps']:.2f}", _ratio(r, "goodput_rps"),
                     f"{r['ttft_mean_s']:.3f}", _ratio(r, "ttft_mean_s"), f"{d['mean']:.0f}", f"{d['p99']:.0f}",
                     str(r["indexed_blocks"]), str(r["index_entries"]), f"{r['hit_rate_local']:.3f}",
                     f"{r['hit_rate_global']:.3f}", f"{r['simulated_requests_per_s']:.0f}", f"{r['rss_mib']:.0f}"])
    return text_table(f"fleet scale: {args.limit} requests of the conversation trace per {args.base} instances, "
                      f"speed {args.speed:g}, TTFT SLO {args.slo_ttft:g} s, TBT SLO {args.slo_tbt * 1e3:g} ms",
                      header, body)


def _ratio(row: dict, key: str) -> str:
    value = row.get(f"{key}_vs_exact")
    return f"{value:.3f}" if value is not None else ""
