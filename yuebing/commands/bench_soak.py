"""`yuebing bench soak`: three times the measured capacity for five minutes on a live
cluster: 429s rather than timeouts, flat memory, SLOs still met by what is admitted
(yuebing/bench/soak.py)."""

from __future__ import annotations

import argparse
import asyncio

from yuebing.commands import add_cluster_flags, add_json_flag, cluster_paths, write_json

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from yuebing.bench.soak import SoakSpec

    p = subparsers.add_parser("soak", help="overload a live cluster for minutes: shedding, memory, SLOs")
    p.add_argument("--overload", type=float, default=SoakSpec.overload, help="times the measured capacity")
    p.add_argument("--minutes", type=float, default=SoakSpec.minutes, help="how long the overload lasts")
    p.add_argument("--capacity-seconds", type=float, default=SoakSpec.capacity_s, help="each capacity run's length")
    p.add_argument("--concurrency", type=int, default=SoakSpec.concurrency, help="clients saturating the cluster")
    p.add_argument("--no-calibration", action="store_true",
                   help="admission by the profile alone (`yuebing up --no-calibrate-time-model`), for comparison")
    add_cluster_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.config import load_config
    from yuebing.bench.soak import Driver, Slo, SoakSpec, deaths, soak
    from yuebing.launcher import up_launcher

    model, work = cluster_paths(args, "soak")
    spec = SoakSpec(args.overload, args.minutes, args.capacity_seconds, args.concurrency)
    calibration = ["--no-calibrate-time-model"] if args.no_calibration else []
    with up_launcher(work, "soak", "--model", str(model), "--max-model-len", "2048", *calibration) as (url, launcher):
        config = load_config(work / "soak" / "cluster.json")
        slo = Slo(config.slo_ttft_ms / 1e3, config.slo_tbt_ms / 1e3)
        calibrated = f"calibrated to the {config.slo_attainment:.0%} quantile" if config.calibrate_time_model else "profile alone"
        print(f"cluster up at {url} (logs in {work}); admission {config.admission} ({calibrated}), "
              f"SLOs: TTFT {config.slo_ttft_ms:.0f} ms, TBT {config.slo_tbt_ms:.0f} ms", flush=True)
        driver = Driver(url, model.name, slo, spec, config.request_timeout_s + 10)
        result = asyncio.run(soak(driver, launcher.pid, lambda text: print(text, flush=True)))
        died = deaths(work / "soak.log")
    print(f"processes that died: {died}")
    write_json({**result, "deaths": died}, args.json)
    return 0 if died == 0 else 1
