"""`yuebing sim-planner`: the planner (services/conductor/planner.py) against every
static split of the same fleet, on a trace whose mix shifts and on the steady one,
in the simulator with the Conductor's own code. Prints a table of goodput per split
and the planner's, and with --plot-dir draws the planner's split over time."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from yuebing.commands import add_json_flag, text_table, write_json
from yuebing.lab import data

GROUP = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-planner", help="the planner against every static prefill:decode split, on a "
                              "shifting and a steady trace")
    p.add_argument("--profile", default=str(data.GPU_PROFILE), help="timing profile (default: an H100's, shipped)")
    p.add_argument("--instances", type=int, default=16, help="the fleet: prefill plus decode instances")
    p.add_argument("--limit", type=int, default=None, help="requests of the conversation trace (its first N; "
                   "default: all)")
    p.add_argument("--copies", type=int, default=3, help="users: the trace tiled this many times, interleaved")
    p.add_argument("--speed", type=float, default=3.0, help="replay speed factor")
    p.add_argument("--slo-ttft", type=float, default=10.0, help="TTFT SLO, s")
    p.add_argument("--slo-tbt", type=float, default=0.1, help="TBT SLO, s")
    p.add_argument("--middle", default="0.5,0.0625,8000", help="the shifting trace's middle third: input,output "
                   "length factors[,document tokens appended to each prompt] (default: a long document and a short "
                   "answer each)")
    p.add_argument("--outer", default="0.25,6", help="... and its outer thirds' (default: short prompts, long "
                   "answers; 1,1: the trace as it is); the steady trace is the outer mix throughout")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run at once (processes)")
    p.add_argument("--mode", choices=("disaggregated", "adaptive"), default="disaggregated",
                   help="serving mode of every run (adaptive: what a split cannot serve in time spills onto decode "
                        "instances)")
    p.add_argument("--plot-dir", help="write the planner's split over time here (PNG)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.predictor import load_predictor
    from yuebing.lab.sim_config import SimConfig
    from yuebing.lab.trace import Mix, load_trace, shifting, tiled

    if args.instances < 2 or args.copies < 1 or args.jobs < 1:
        raise ValueError("--instances: at least one prefill and one decode instance; --copies and --jobs at least 1")
    middle, outer = Mix.parse(args.middle), Mix.parse(args.outer)
    predictor = load_predictor(args.profile, None)
    trace = tiled(load_trace(data.CONVERSATION_TRACE, args.limit), args.copies)
    base = SimConfig(speed=args.speed, admission="predictive", slo_ttft_s=args.slo_ttft, slo_tbt_s=args.slo_tbt,
                     learn_decode_time=True, mode=args.mode)
    traces = {"shifting": shifting(trace, middle, outer), "steady": shifting(trace, outer, outer)}
    out, plans = {}, {}
    for name, t in traces.items():
        out[name], plans[name] = _compare(name, t, base, args, predictor)
    print(_table(out, args))
    if args.plot_dir:
        print("plot:", _plot(plans, Path(args.plot_dir) / "planner_split.png", args.instances))
    write_json({"config": vars(args) | {"func": None}, **out}, args.json)
    return 0


def _compare(name: str, trace, base, args: argparse.Namespace, predictor) -> tuple[dict, list[tuple[float, int]]]:
    """Goodput of each static split, of the planner (started from the best one), and
    the oracle's (`_oracle`)."""
    from yuebing.lab.sim import simulate

    n = args.instances
    splits = {p: replace(base, prefill=p, decode=n - p) for p in range(base.fewest_prefill, n)}
    runs = _simulate_all(name, trace, splits, predictor, args.jobs)
    static = {p: run.result["goodput_rps"] for p, run in runs.items()}
    best = max(static, key=lambda p: (static[p], -abs(p - n / 2)))
    run = simulate(trace, replace(base, prefill=best, decode=n - best, planner=True), predictor)
    print(f"{name}: planner from {best}P: {run.result['goodput_rps']:.2f} req/s", flush=True)
    planned, oracle = run.result["goodput_rps"], _oracle(runs, runs[best].result["duration_s"])
    return {"static_goodput_rps": static, "best_static": best, "planner_goodput_rps": planned,
            "planner_over_best": planned / static[best] if static[best] else 0.0, "oracle_goodput_rps": oracle,
            "oracle_over_best": oracle / static[best] if static[best] else 0.0,
            "planner_moves": run.result["planner_moves"]}, run.result["planner_split"]


def _simulate_all(name: str, trace, configs: dict, predictor, jobs: int) -> dict:
    """Each configuration's run, `jobs` at once (forked: the trace is not copied
    twice), a line as each ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from yuebing.lab.sim import simulate

    runs = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(simulate, trace, config, predictor): key for key, config in configs.items()}
        for future in as_completed(futures):
            key = futures[future]
            runs[key] = future.result()
            print(f"{name}: {key}P {runs[key].result['goodput_rps']:.2f} req/s ({len(runs)}/{len(configs)})",
                  flush=True)
    return dict(sorted(runs.items()))


def _oracle(runs: dict, seconds: float) -> float:
    """What the best role plan could reach: each third of the trace's requests served
    as well as any static split served them (its good requests under the split best
    for that third), as if roles switched at no cost; over the best static run's time."""
    n = len(next(iter(runs.values())).outcomes)
    thirds = [range(n // 3), range(n // 3, 2 * n // 3), range(2 * n // 3, n)]
    good = sum(max(sum(run.outcomes[i].within_slo for i in part) for run in runs.values()) for part in thirds)
    return good / seconds if seconds else 0.0


def _table(out: dict, args: argparse.Namespace) -> str:
    rows = []
    for name, r in out.items():
        static = r["static_goodput_rps"]
        rows.append([name, *(f"{static[p]:.2f}" for p in sorted(static)), f"{r['planner_goodput_rps']:.2f}",
                     f"{r['planner_over_best']:.2f}x (best {r['best_static']}P)", str(r["planner_moves"]),
                     f"{r['oracle_goodput_rps']:.2f} ({r['oracle_over_best']:.2f}x)"])
    splits = sorted(next(iter(out.values()))["static_goodput_rps"])
    header = ["trace", *(f"{p}P" for p in splits), "planner", "vs best static", "moves", "oracle"]
    return text_table(f"goodput, req/s within both SLOs (TTFT {args.slo_ttft:g} s, TBT {args.slo_tbt * 1e3:g} ms), "
                      f"{args.instances} instances, the trace ({args.limit or 'all'} requests) x{args.copies} at speed {args.speed:g}", header, rows)


def _plot(plans: dict[str, list[tuple[float, int]]], path: Path, n: int) -> str:
    from yuebing.lab.plots import plot_split

    path.parent.mkdir(parents=True, exist_ok=True)
    return plot_split(plans, n, path)
