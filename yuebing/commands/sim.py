"""`yuebing sim`: a simulated cluster replays a trace (yuebing/lab/sim.py): policies,
admission modes and serving modes side by side, the highest replay speed within the
SLOs (`--find-capacity`; with several serving modes, a table of capacity against
colocated beside the paper's, commands/sim_modes.py), or the prefill:decode splits of
a fixed total (`--pd-total`).

Where requests come from (`--trace` or `--synthetic`) is shared with `yuebing bench
replay` and `bench fidelity` (commands/replay.py): `add_trace_flags`, `load_trace`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from yuebing.commands import add_json_flag, write_json
from yuebing.flags import Alias, add_flags, from_args
from yuebing.lab import data
from yuebing.lab.sim_config import SimConfig
from yuebing.lab.trace import SyntheticSpec

if TYPE_CHECKING:
    from shared.predictor import Predictor
    from yuebing.lab.trace import TraceRequest

GROUP = None

SHIPPED_TRACES = {"conversation": data.CONVERSATION_TRACE}  # `--trace NAME`
SYNTHETIC = {"aliases": {"rate_per_s": Alias(flag="rate")}, "skip": ("requests",)}  # requests: --synthetic N
# SimConfig's fields that are no flag of their own: the SLOs are given in ms, policy
# and admission may list several, the seed is the synthetic trace's.
SIM = {
    "aliases": {"decode_time_s": Alias(flag="decode-time"), "request_timeout_s": Alias(flag="request-timeout")},
    "skip": ("policy", "admission", "slo_ttft_s", "slo_tbt_s", "block_tokens", "sample_every_s", "seed", "host",
             "mode", "conditional_rule"),
}


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    """Where requests come from, for the simulator and the live benchmarks alike."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="trace in Mooncake's JSONL format (plain or gzipped), or a "
                     f"shipped one by name: {', '.join(SHIPPED_TRACES)}")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic requests instead (Poisson arrivals)")
    add_flags(p, SyntheticSpec, **SYNTHETIC)
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    add_json_flag(p)


def load_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests `add_trace_flags`' flags name."""
    from yuebing.lab import trace

    if args.synthetic:
        return trace.synthetic(from_args(SyntheticSpec, args, **SYNTHETIC, requests=args.synthetic))
    return trace.load_trace(SHIPPED_TRACES.get(args.trace, args.trace), args.limit)


def trace_name(args: argparse.Namespace) -> str:
    return "synthetic" if args.synthetic else args.trace


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate a cluster replaying a trace (policies from the Conductor)")
    add_trace_flags(p)
    p.add_argument("--profile", default=str(data.GPU_PROFILE), help="timing profile (rows of measured times; the "
                   "default: an H100's, shipped in yuebing/lab/data)")
    p.add_argument("--profile-model", default="llama3-8b", help="rows of this model (empty: all)")
    p.add_argument("--gpus-per-instance", type=int, default=1,
                   help="GPUs an instance shards the model over (tensor parallelism: yuebing/lab/tensor_parallel.py)")
    p.add_argument("--tp-efficiency", type=float, default=1.0,
                   help="a GPU's speed on its slice of a layer against the whole layer's (1: ideal)")
    p.add_argument("--link", default="a800-nvlink", choices=("a800-nvlink", "h100-nvlink"),
                   help="the interconnect tensor parallelism's all-reduces cross")
    p.add_argument("--gpu", default="h100", choices=("h100", "a800"),
                   help="the instances' GPU: another than the profile's (an H100) scales its times by the ratio of "
                   "compute peaks (prefill) and memory bandwidths (decode)")
    p.add_argument("--prefill-time-scale", type=float, default=1.0,
                   help="what-if: the profile's prefill times × this (e.g. 0.5: instances prefill twice as fast)")
    p.add_argument("--policy", default=SimConfig.policy, help="one name, or several comma-separated to compare")
    p.add_argument("--admission", default=SimConfig.admission, help="one name, or several comma-separated to compare")
    p.add_argument("--slo-ttft-ms", type=float, default=SimConfig.slo_ttft_s * 1e3, help="TTFT SLO")
    p.add_argument("--slo-tbt-ms", type=float, default=SimConfig.slo_tbt_s * 1e3,
                   help="TBT SLO (on a request's longest 10 %% of gaps)")
    p.add_argument("--tbt-slos", default="", help="several TBT SLOs, ms, comma-separated (instead of --slo-tbt-ms): "
                   "a run each; with --find-capacity and several modes, a row each of the table against colocated")
    p.add_argument("--mode", default=SimConfig.mode,
                   help="serving mode: disaggregated, colocated or conditional; several comma-separated to compare")
    p.add_argument("--conditional-rule", default=SimConfig.conditional_rule,
                   help="conditional mode's rule: mooncake, dynamo or llmd; several comma-separated to compare")
    add_flags(p, SimConfig, **SIM)
    p.add_argument("--find-capacity", action="store_true",
                   help="binary-search the highest replay speed meeting --target")
    p.add_argument("--target", type=float, default=0.9, help="share of requests within both SLOs")
    p.add_argument("--capacity-probes", type=int, default=12,
                   help="--find-capacity's probes (a bisection on a log scale from 0.05× to 64×: 9 is within 1.4 %%)")
    p.add_argument("--pd-total", type=int, default=0, help="sweep prefill:decode splits of this many instances")
    p.add_argument("--plot-dir", help="write PNG plots here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args)
    predictor, configs = _predictor(args, trace), sim_configs(args)
    if args.find_capacity:
        found = _find_capacity(trace, configs, predictor, args, trace_name(args))
        output = {"trace": trace_name(args), "capacity": found}
    else:
        output = {"trace": trace_name(args), "config": vars(args) | {"func": None},
                  "runs": _compare(trace, configs, predictor, args)}
    write_json(output, args.json)
    return 0


def _predictor(args: argparse.Namespace, trace: Sequence[TraceRequest]) -> Predictor:
    """The profile's time model, for instances of --gpus-per-instance GPUs: refused
    where such an instance cannot hold the model and the trace's longest request."""
    from shared.predictor import load_predictor
    from yuebing.lab.tensor_parallel import GPUS, LINKS, InstanceShape, instance_predictor

    instance = InstanceShape(args.gpus_per_instance, args.tp_efficiency, LINKS[args.link], gpu=GPUS[args.gpu])
    longest = max(r.input_length + r.output_length for r in trace)
    predictor = instance_predictor(load_predictor(args.profile, args.profile_model or None), args.profile_model,
                                   instance, longest)
    if args.prefill_time_scale != 1.0:  # a what-if on the profile: the Conductor and the instances alike see it
        predictor = predictor.scaled(prefill=args.prefill_time_scale)
    return predictor


def sim_configs(args: argparse.Namespace) -> list[SimConfig]:
    """One configuration per policy × admission given, or per P:D split (--pd-total,
    for the first policy and admission)."""
    base = from_args(SimConfig, args, **SIM, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tbt_s=args.slo_tbt_ms / 1e3,
                     seed=args.seed, mode=_modes(args)[0][0])  # its mode checked with its split (--prefill 0)
    configs = [replace(base, policy=p, admission=a) for p in args.policy.split(",") for a in args.admission.split(",")]
    configs = [replace(c, mode=m, conditional_rule=rule) for c in configs for m, rule in _modes(args)]
    if args.tbt_slos:
        configs = [replace(c, slo_tbt_s=float(ms) / 1e3) for ms in args.tbt_slos.split(",") for c in configs]
    if args.pd_total:
        configs = [replace(configs[0], prefill=p, decode=args.pd_total - p) for p in range(1, args.pd_total)]
    return configs


def _modes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(mode, conditional rule) pairs: conditional once per rule given."""
    rules = args.conditional_rule.split(",")
    return [(m, r) for m in args.mode.split(",") for r in (rules if m == "conditional" else rules[:1])]


def _find_capacity(trace: Sequence[TraceRequest], configs: Sequence[SimConfig], predictor: Predictor,
                   args: argparse.Namespace, name: str) -> list[dict]:
    from yuebing.lab.sim import find_capacity

    detailed = len({(c.mode, c.conditional_rule, c.slo_tbt_s) for c in configs}) > 1

    def show(probe: dict) -> None:  # a search takes a while: each probe as it comes
        print(f"  {_label(probe, detailed)}: speed {probe['speed']:.3f} → attainment {probe['slo_attainment']:.3f}", flush=True)

    target = args.target
    found = [find_capacity(trace, c, predictor, target=target, steps=args.capacity_probes, on_probe=show)
             for c in configs]
    print(f"highest replay speed with ≥ {target:.0%} of requests within both SLOs:")
    for f in found:
        print(f"  {_label(f, detailed):>40} speed {f['capacity_speed']:.3f}×  ({f.get('capacity_rps', 0):.2f} req/s)")
    if len({f["mode"] for f in found}) > 1:
        from yuebing.commands.sim_modes import capacity_table

        print(capacity_table(found, name))
    return found


def _label(f: dict, detailed: bool) -> str:
    """policy/admission, and the serving mode and TBT SLO where several are compared."""
    label = f"{f['policy']}/{f['admission']}"
    return f"{label} {f['mode']} TBT {f['slo_tbt_s'] * 1e3:.0f} ms" if detailed else label


def _compare(trace: Sequence[TraceRequest], configs: Sequence[SimConfig], predictor: Predictor,
             args: argparse.Namespace) -> list[dict]:
    from yuebing.lab.plots import plot_runs
    from yuebing.lab.sim import simulate

    runs = [simulate(trace, c, predictor, progress=True) for c in configs]
    print(f"{len(trace)} requests, {args.prefill} prefill + {args.decode} decode, speed {args.speed}×")
    print(table([r.result for r in runs]))
    for r in runs:
        for tenant, t in r.result["tenants"].items():
            print(f"  {r.result['policy']}/{r.result['admission']} tenant {tenant}: {t['requests']} requests, "
                  f"{t['rejected']} refused, {t['slo_attainment']:.0%} within both SLOs, "
                  f"{t['goodput_rps']:.2f} good req/s")
    if args.pd_total:
        best = max(runs, key=lambda r: r.result["goodput_rps"]).result
        print(f"goodput peaks at {best['prefill']} prefill : {best['decode']} decode ({best['goodput_rps']:.2f} req/s)")
    if args.plot_dir:
        for path in plot_runs(runs, args.plot_dir):
            print(f"wrote {path}")
    return [r.result for r in runs]


COLUMNS: tuple[tuple[str, str | Callable[[dict], Any], str], ...] = (
    ("policy", "policy", "{}"),
    ("admission", "admission", "{}"),
    ("P:D", lambda r: f"{r['prefill']}:{r['decode']}", "{}"),
    ("mode", "mode", "{}"),
    ("local", lambda r: sum(n for k, n in r["mode_decisions"].items() if k.startswith("local:")), "{}"),
    ("TTFT mean s", lambda r: r["ttft_s"]["mean"], "{:.2f}"),
    ("p90", lambda r: r["ttft_s"]["p90"], "{:.2f}"),
    ("p99", lambda r: r["ttft_s"]["p99"], "{:.2f}"),
    ("TBT mean ms", lambda r: r["tbt_s"]["mean"] * 1e3, "{:.1f}"),
    ("p99", lambda r: r["tbt_s"]["p99"] * 1e3, "{:.1f}"),
    ("SLO att.", "slo_attainment", "{:.3f}"),
    ("goodput/s", "goodput_rps", "{:.2f}"),
    ("done", "completed", "{}"),
    ("rejected", "rejected", "{}"),
    ("wasted", "wasted_prefill", "{}"),
    ("timed out", "failed", "{}"),
    ("hit rate", "cache_hit_rate", "{:.3f}"),
    ("prefill s", "prefill_busy_s", "{:.0f}"),
    ("replicas", lambda r: r["replicas"]["mean"], "{:.2f}"),
    ("req/s sim", "simulated_requests_per_s", "{:.0f}"),
)


def table(results: Sequence[dict]) -> str:
    """The simulated runs' results, a row each, columns right-aligned."""
    cells = [[fmt.format(key(r) if callable(key) else r[key]) for _, key, fmt in COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (h, _, _) in enumerate(COLUMNS)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(COLUMNS, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
