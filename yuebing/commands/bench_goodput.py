"""`yuebing bench goodput`: per serving mode, the highest request rate at which at
least 90 % of requests meet both SLOs, live: a `yuebing up --mode M` cluster per mode,
one after the other, each replaying the same slice of the conversation trace at rates
a bisection picks (yuebing/bench/goodput.py); a table against colocated, `--json`,
`--plot`, and with `--plain-vllm` two plain vLLM servers as a baseline."""

from __future__ import annotations

import argparse
from pathlib import Path

from yuebing.commands import add_cluster_flags, add_json_flag, cluster_paths, write_json
from yuebing.flags import add_flags, from_args

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.goodput import GoodputSpec

    p = subparsers.add_parser("goodput", help="per serving mode, the highest rate with >= 90 %% within both SLOs, live")
    add_flags(p, GoodputSpec)
    add_cluster_flags(p)
    add_json_flag(p)
    p.add_argument("--plot", metavar="PATH", help="write SLO attainment against rate, a line per mode, here (PNG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from yuebing.bench.goodput import Driver, GoodputSpec, plot, sweep_table, table, to_json
    from yuebing.lab.trace import base_rate
    from yuebing.progress import progress

    spec = from_args(GoodputSpec, args)
    model, work = cluster_paths(args, "goodput")
    servers = len(spec.mode_list) + spec.plain_vllm
    with progress(total=servers * spec.probe_count, desc="goodput", unit="probe") as bar:
        driver = Driver(spec, model, work, lambda text: print(text, flush=True), bar)
        base = base_rate(driver.raw)
        print(f"{len(driver.raw)} requests of {spec.trace or 'the conversation trace'} ({base:.2f} req/s at speed 1), "
              f"sent by {spec.client}, lengths "
              f"× {spec.length_factor:g}; SLOs: TTFT {spec.slo_ttft_ms:g} ms, TBT {spec.slo_tbt_ms:g} ms "
              f"({'longest 10 % of gaps' if spec.tbt_stat == 'tail' else 'mean gap'}); target {spec.target:.0%}; "
              f"{_rates(spec)}; logs in {work}", flush=True)
        results = [_one(driver, work, model, mode) for mode in spec.mode_list]
        if spec.plain_vllm:
            results.append(_one(driver, work, model, None))
    print(f"\ncapacity: the highest rate probed with ≥ {spec.target:.0%} of requests within both SLOs "
          "(attainment columns at that rate)")
    print(table(results))
    if spec.rate_list:
        print("\nrequests within both SLOs at each rate (× plain vLLM where it was measured)")
        print(sweep_table(results))
    for r in results:
        for note in r.notes:
            print(f"{r.name}: {note}")
        if r.spans is not None:
            print(f"{r.name}: {r.spans} spans received")
    write_json(to_json(results, spec, base), args.json)
    if args.plot:
        print("wrote", plot(results, spec.target, Path(args.plot)))
    return 0 if all(not r.notes for r in results) else 1


def _one(driver, work: Path, model: Path, mode: str | None):
    """A mode's result (None: plain vLLM); a server that would not start is a note,
    and the other modes still run."""
    from yuebing.bench.goodput import PLAIN_VLLM, ModeResult, Search, mode_name, run_mode, run_plain_vllm

    try:
        return run_mode(driver, work, model, mode) if mode else run_plain_vllm(driver, work, model)
    except RuntimeError as e:
        name = mode_name(mode, driver.spec) if mode else PLAIN_VLLM
        print(f"{name}: {e}", flush=True)
        return ModeResult(name, Search((), driver.spec.target), notes=[f"not measured: {e}"])


def _rates(spec) -> str:
    if spec.rate_list:
        return f"rates {', '.join(f'{r:g}' for r in spec.rate_list)} req/s"
    return f"rates {spec.min_rate:g}–{spec.max_rate:g} req/s, {spec.probes} probes"
