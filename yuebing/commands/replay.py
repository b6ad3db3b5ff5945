"""`yuebing bench replay`: a trace replayed against a live gateway, measured as the
simulator reports (yuebing/lab/replay.py); and `yuebing bench fidelity`: the same
trace live and simulated, mean TTFT and TBT side by side (yuebing/lab/fidelity.py).

The trace is scaled to the small model first: `--length-factor` scales its lengths
and its 512-token blocks alike, so prefix sharing survives.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from yuebing.commands import positive_int, write_json
from yuebing.commands.sim import add_trace_flags, load_trace, trace_name

if TYPE_CHECKING:
    from yuebing.lab.replay import ReplayOptions
    from yuebing.lab.sim_config import SimConfig
    from yuebing.lab.trace import TraceRequest

GROUP = "bench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help="replay a trace against a live gateway (streaming)")
    _add_live_flags(p)
    p.add_argument("--plot-dir", help="write TTFT/TBT CDFs here")
    p.set_defaults(func=run)

    f = subparsers.add_parser("fidelity", help="the same trace live and in the simulator: mean TTFT and TBT")
    _add_live_flags(f)
    f.add_argument("--prefill", type=int, default=1, help="the live cluster's prefill instances")
    f.add_argument("--decode", type=int, default=1, help="the live cluster's decode instances")
    f.add_argument("--policy", default="round_robin", help="the live cluster's policy")
    f.add_argument("--pool-blocks", type=int, default=2048, help="prefix-cache blocks per prefill engine")
    f.add_argument("--profile", default="", help="the live profile (default: the shipped one)")
    f.add_argument("--plot-dir", default="", help="write TTFT/TBT CDFs and per-request live-vs-sim plots here")
    f.add_argument("--repeats", type=positive_int, default=1,
                   help="calibrate and replay this many times (fresh prompts each) and compare the means over the runs")
    f.set_defaults(func=run_fidelity)


def _add_live_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the benchmarks that replay a trace against a live gateway."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    add_trace_flags(p)
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    p.add_argument("--length-factor", type=float, default=0.25, help="scale lengths (and 512-token blocks) by this")
    p.add_argument("--max-input", type=int, default=2048, help="prompt tokens at most, after scaling")
    p.add_argument("--max-output", type=int, default=64, help="output tokens at most, after scaling")
    p.add_argument("--model-name", default="yuebing-tiny", help="the model name the gateway serves")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="sent as x-yuebing-slo-ttft-ms (0: cluster default)")
    p.add_argument("--slo-tbt-ms", type=float, default=0.0, help="sent as x-yuebing-slo-tbt-ms (0: cluster default)")
    p.add_argument("--api-key", default=os.environ.get("YUEBING_API_KEY"), help="default: $YUEBING_API_KEY")
    p.add_argument("--prompt-seed", type=int, default=int(time.time()),
                   help="salt of the prompt tokens (default: now, so nothing is cached from an earlier run)")


def replay_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace a live run replays, scaled to the small model."""
    from yuebing.lab.trace import rescale

    return rescale(load_trace(args), speed=args.speed, length_factor=args.length_factor, max_input=args.max_input,
                   max_output=args.max_output)


def replay_options(args: argparse.Namespace) -> ReplayOptions:
    from yuebing.lab.replay import ReplayOptions
    from yuebing.lab.trace import TRACE_BLOCK_TOKENS

    return ReplayOptions(
        model=args.model_name, block_tokens=round(TRACE_BLOCK_TOKENS * args.length_factor),
        slo_ttft_ms=args.slo_ttft_ms, slo_tbt_ms=args.slo_tbt_ms, api_key=args.api_key, salt=args.prompt_seed,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from yuebing.lab.outcome import summarize
    from yuebing.lab.replay import replay

    trace = replay_trace(args)
    outcomes, wall = asyncio.run(replay(args.url, trace, replay_options(args)))
    result = summarize(outcomes, wall)
    ttft, tbt = result["ttft_s"], result["tbt_s"]
    print(f"{len(trace)} requests against {args.url} in {wall:.1f}s")
    print("TTFT ms " + "  ".join(f"{k} {ttft[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")))
    print("TBT  ms " + "  ".join(f"{k} {tbt[k] * 1e3:.2f}" for k in ("mean", "p50", "p90", "p99")))
    print(f"completed {result['completed']}  rejected (429) {result['rejected']}  failed {result['failed']}  "
          f"SLO attainment {result['slo_attainment']:.3f}  goodput {result['goodput_rps']:.2f}/s  "
          f"cache hit rate {result['cache_hit_rate']:.3f}")
    if args.plot_dir:
        from yuebing.lab.plots import plot_cdfs

        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        print("wrote", plot_cdfs({"live": outcomes}, Path(args.plot_dir) / "cdf.png"))
    write_json({"url": args.url, "trace": trace_name(args), "speed": args.speed, "length_factor": args.length_factor,
                **result}, args.json)
    return 0 if result["failed"] == 0 else 1


def fidelity_sim_config(args: argparse.Namespace, block_tokens: int) -> tuple[SimConfig, Path]:
    """The live cluster as the simulator sees it, and the live profile's path."""
    import json

    from shared.config import ClusterConfig, profile_path
    from yuebing.lab.sim_config import SimConfig

    profile = Path(args.profile) if args.profile else profile_path(ClusterConfig())
    meta = json.loads(profile.read_text())["meta"]
    config = SimConfig(
        prefill=args.prefill, decode=args.decode, policy=args.policy, block_tokens=block_tokens,
        pool_blocks=args.pool_blocks, kv_bytes_per_token=meta["kv_bytes_per_token"],
        bandwidth_gbps=meta["transfer_GBps"], chunk_tokens=ClusterConfig().step_tokens, slo_ttft_s=1e9, slo_tbt_s=1e9,
    )
    return config, profile


def run_fidelity(args: argparse.Namespace) -> int:
    from shared.predictor import load_predictor
    from yuebing.lab.fidelity import fidelity

    options = replay_options(args)
    config, profile = fidelity_sim_config(args, options.block_tokens)
    run_ = fidelity(args.url, replay_trace(args), options, config, load_predictor(profile), repeats=args.repeats)
    for i, r in enumerate(run_.result["runs"]):
        print(f"run {i + 1}: host sharing (calibrated live): {_host_line(r['host'])}")
        print("  live decode gaps by streams decoding / a prefill waiting (mean ms, gaps): "
              + ", ".join(f"{k} {g['mean_ms']:.1f} ({g['gaps']})" for k, g in r["live_decode_gaps"].items()))
        _print_compare(r["compare"], "  ")
    if len(run_.result["runs"]) > 1:
        print(f"over the {len(run_.result['runs'])} runs (means of the runs' means):")
        _print_compare(run_.result["compare"], "")
    write_json(run_.result, args.json)
    if args.plot_dir:
        from yuebing.lab.plots import plot_cdfs, plot_pairs

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        print("wrote", plot_cdfs({"live": run_.live, "simulated": run_.simulated}, out / "fidelity_cdf.png"))
        print("wrote", plot_pairs(run_.live, run_.simulated, out / "fidelity_pairs.png"))
    return 0


def _host_line(h: dict) -> str:
    """A calibrated HostSharing (as a dict), in words."""
    return (f"prefill ×{h['prefill_scale']:.2f} the profile, +{h['prefill_slowdown_while_decoding']:.1%} while "
            f"decoding and +{h['prefill_slowdown_per_decoding']:.1%} per request decoding; "
            f"decode ×{h['decode_scale']:.2f} the profile, step +{h['step_overhead_s'] * 1e3:.2f} ms, "
            f"+{h['decode_slowdown_per_prefill']:.1%} per prefill running; "
            f"first-token overhead {h['first_token_overhead_s'] * 1e3:.1f} ms, hand-off {h['handoff_s'] * 1e3:.1f} ms, "
            f"join step +{h['join_step_s'] * 1e3:.1f} ms, join overhead {h['join_overhead_s'] * 1e3:.1f} ms")


def _print_compare(compare: dict, indent: str) -> None:
    for key, c in compare.items():
        print(f"{indent}{key:>12}: live {c['live'] * 1e3:8.2f} ms   sim {c['sim'] * 1e3:8.2f} ms   "
              f"sim/live {c['sim_over_live']:.3f}")
