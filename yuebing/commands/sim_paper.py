"""`yuebing sim-paper`: Mooncake's end-to-end experiments (FAST '25, §8) in the
simulator with the paper's instances (LLaMA2-70B on nodes of 8 GPUs), its vLLM
baseline and today's, each figure printed beside the paper's number and plotted
(setups and the paper's numbers: yuebing/lab/paper.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from yuebing.commands import add_json_flag, text_table, write_json
from yuebing.lab import data, paper
from yuebing.lab.plots import plot_capacity, plot_cdfs

if TYPE_CHECKING:
    from shared.predictor import Predictor
    from yuebing.lab.sim_config import SimConfig
    from yuebing.lab.trace import TraceRequest

GROUP = None
PARTS = ("fig11", "fig12", "fig13", "table3")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-paper", help="Mooncake's end-to-end experiments with its instances and baselines, "
                              "beside the paper's figures")
    p.add_argument("--profile", default=str(data.GPU_PROFILE), help="timing profile (default: an H100's, shipped in "
                   "yuebing/lab/data)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which to run, comma-separated: {', '.join(PARTS)} "
                   "(fig13 uses fig11's capacity)")
    p.add_argument("--limit", type=int, default=4000, help="requests of the conversation trace (its first N)")
    p.add_argument("--long-context-requests", type=int, default=200, help="requests per length of Fig. 12's data")
    p.add_argument("--lengths", default=",".join(map(str, paper.LONG_CONTEXT_LENGTHS)),
                   help="Fig. 12's input lengths, tokens, comma-separated")
    p.add_argument("--gpu", default="a800", choices=("a800", "h100"),
                   help="the instances' GPU (the paper's: a800; the profile's times scaled to it, "
                   "yuebing/lab/tensor_parallel.py)")
    p.add_argument("--probes", type=int, default=9, help="each capacity search's probes (9: within 1.4 %%)")
    p.add_argument("--plot-dir", help="write a PNG per figure here")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.predictor import load_predictor

    parts = _parts(args.parts)
    predictor = load_predictor(args.profile, paper.MODEL)
    print(_header(args))
    out: dict = {"config": vars(args) | {"func": None}}
    if "fig11" in parts or "fig13" in parts:
        out |= _conversation(args, predictor, parts)
    if "fig12" in parts:
        out["fig12"] = _fig12(args, predictor)
    if "table3" in parts:
        out["table3"] = _table3(predictor, args.gpu)
    write_json(out, args.json)
    return 0


def _parts(text: str) -> set[str]:
    parts = {x.strip() for x in text.split(",") if x.strip()}
    unknown = parts - set(PARTS)
    if unknown or not parts:
        raise ValueError(f"--parts takes {', '.join(PARTS)}; got {text!r}")
    return parts


def _header(args: argparse.Namespace) -> str:
    from yuebing.lab.tensor_parallel import GPUS

    i = paper.INSTANCE
    return (f"{paper.MODEL} on instances of {i.gpus} × {GPUS[args.gpu].name} ({i.link.name}, tensor parallel, "
            f"efficiency {i.efficiency:g}), times from {args.profile}; capacity: the highest rate with 90 % of "
            f"requests within both SLOs ({args.probes} probes)")


def _predictor_for(one_gpu: Predictor, trace: Sequence[TraceRequest], gpu: str) -> Predictor:
    """The paper's instance (on `gpu`), refused where it cannot hold the trace's longest request."""
    from yuebing.lab.tensor_parallel import GPUS, instance_predictor

    longest = max(r.input_length + r.output_length for r in trace)
    return instance_predictor(one_gpu, paper.MODEL, replace(paper.INSTANCE, gpu=GPUS[gpu]), longest)


def _progress(probe: dict) -> None:  # a search takes a while: each probe as it comes
    print(f"  {probe['mode']} TBT {probe['slo_tbt_s'] * 1e3:.0f} ms: speed {probe['speed']:.3f} → "
          f"attainment {probe['slo_attainment']:.3f}", flush=True)


def _conversation(args: argparse.Namespace, one_gpu: Predictor, parts: set[str]) -> dict:
    """Fig. 11's capacities on the conversation trace; Fig. 13's attainment at Mooncake's
    capacity under Fig. 13's SLOs (TBT 100 ms)."""
    from yuebing.lab.trace import base_rate, load_trace

    trace = load_trace(data.CONVERSATION_TRACE, args.limit)
    predictor = _predictor_for(one_gpu, trace, args.gpu)
    setups = paper.conversation_setups(paper.mean_context(trace))
    rows = paper.capacities_per_tbt(trace, setups, predictor, args.probes, _progress)
    print(_fig11_table(rows, len(trace)))
    out = {"fig11": rows}
    if path := _plot_path(args, "fig11.png"):
        print(f"wrote {plot_capacity(rows, 'tbt_slo_ms', 'TBT SLO (ms)', 'conversation trace', path)}")
    if "fig13" in parts:
        mooncake = next(r for r in rows if r["tbt_slo_ms"] == 100 and r["setup"] == setups[0].name)
        speed = mooncake["capacity_rps"] / base_rate(trace)
        found = paper.attainment(trace, setups, predictor, speed)
        print(_fig13_table(found, mooncake))
        out["fig13"] = {"speed": speed, "attainment": [{k: getattr(a, k) for k in ("setup", "ttft", "tbt", "both")}
                                                       for a in found]}
        out["fig13"]["paper_share_at"] = _where_paper_share(trace, setups, predictor, speed)
        if path := _plot_path(args, "fig13.png"):
            print(f"wrote {plot_cdfs({a.setup: a.outcomes for a in found}, path)}")
    return out


def _fig11_table(rows: list[dict], requests: int) -> str:
    names = list(dict.fromkeys(r["setup"] for r in rows))
    baselines = list(rows[0]["gain_over"])
    table = []
    for ms in paper.TBT_SLOS_MS:
        by = {r["setup"]: r for r in rows if r["tbt_slo_ms"] == ms}
        gains = by[names[0]]["gain_over"]
        table.append([f"{ms} ms", *(f"{by[n]['capacity_rps']:.2f}" for n in names), *(_pct(gains[b]) for b in baselines),
                      f"{paper.FIG11_GAIN_PCT['conversation'][ms]:+d} %"])
    return text_table(f"Fig. 11: capacity, req/s, conversation trace ({requests} requests), TTFT ≤ 30 s; Mooncake's "
                      "gain over each vLLM", ["TBT SLO", *names, *(f"gain/{_short(b)}" for b in baselines),
                                              "paper's gain"], table)


def _short(name: str) -> str:
    """A vLLM setup's name without the instance count, for a column."""
    return name.split("] ", 1)[-1]


def _fig13_table(found: list, mooncake: dict) -> str:
    said = paper.FIG13["tbt_attainment"]
    table = [[a.setup, f"{a.ttft:.0%}", f"{a.tbt:.0%}", f"{a.both:.0%}",
              f"{said['Mooncake' if i == 0 else 'vLLM']:.0%}" if i < 2 else "-"] for i, a in enumerate(found)]
    gains = ", ".join(f"{_pct(g)} over {_short(b)}" for b, g in mooncake["gain_over"].items())
    title = (f"Fig. 13: at Mooncake's capacity ({mooncake['capacity_rps']:.2f} req/s), share of requests within "
             f"TTFT ≤ 30 s and TBT ≤ 100 ms; Mooncake serves {gains} (paper: +{paper.FIG13['gain_pct']} %)")
    return text_table(title, ["setup", "TTFT", "TBT", "both", "paper's TBT"], table)


def _where_paper_share(trace: Sequence[TraceRequest], setups: list, predictor: Predictor, speed: float) -> dict:
    """Where the paper's vLLM meets the TBT SLO for the paper's share of requests, and
    how Mooncake fares at that load: what sets Fig. 13's figures apart."""
    from yuebing.lab.trace import base_rate

    share = paper.FIG13["tbt_attainment"]["vLLM"]
    at = paper.speed_at_tbt_attainment(trace, setups[1], predictor, share, speed / 4, speed * 4)
    mooncake = paper.attainment(trace, setups[:1], predictor, at)[0]
    rps = at * base_rate(trace)
    print(f"the paper's vLLM meets TBT ≤ 100 ms for {share:.0%} at {rps:.2f} req/s ({at / speed:.2f}× Mooncake's "
          f"capacity); there Mooncake meets TTFT for {mooncake.ttft:.0%}, TBT for {mooncake.tbt:.0%}")
    return {"rps": rps, "of_mooncake_capacity": at / speed, "mooncake_ttft": mooncake.ttft, "mooncake_tbt": mooncake.tbt}


def _fig12(args: argparse.Namespace, one_gpu: Predictor) -> list[dict]:
    """Capacities on the long-context synthetic data, a length at a time."""
    rows = []
    for length in (int(x) for x in args.lengths.split(",") if x.strip()):
        trace = paper.long_context_trace(length, args.long_context_requests)
        predictor = _predictor_for(one_gpu, trace, args.gpu)
        found = paper.capacities(trace, paper.long_context_setups(length), predictor, args.probes, _progress)
        rows += [r | {"input_tokens": length} for r in found]
    print(_fig12_table(rows))
    if path := _plot_path(args, "fig12.png"):
        print(f"wrote {plot_capacity(rows, 'input_tokens', 'input tokens', 'long-context data', path)}")
    return rows


def _fig12_table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["setup"] for r in rows))
    mooncakes = [r["setup"] for r in rows[: len(names)] if r["setup"].startswith("Mooncake")]
    table = []
    for length in dict.fromkeys(r["input_tokens"] for r in rows):
        by = {r["setup"]: r for r in rows if r["input_tokens"] == length}
        gains = [_pct(by[n]["gain_over"][names[len(mooncakes)]]) for n in mooncakes]
        table.append([f"{length // 1024}k", *(f"{by[n]['capacity_rps']:.3f}" for n in names), *gains])
    low, high = paper.FIG12_GAIN_PCT
    return text_table(f"Fig. 12: capacity, req/s, long-context data (TTFT ≤ {paper.TTFT_X:g}×, TBT ≤ {paper.TBT_X:g}× a "
                      f"lone request's); Mooncake's gain over the paper's vLLM (paper: +{low} % to +{high} %)",
                      ["input", *names, *(f"gain {n.split('-', 1)[1]}" for n in mooncakes)], table)


def _table3(one_gpu: Predictor, gpu: str) -> dict:
    """Table 3 twice: as docs/benchmarks/simulator.md reproduces it (one-GPU LLaMA2-70B
    instances, prefill at 0.45× the profile's time, a decode batch of 24), and with the
    paper's instances; 8P+8D at 2× replay both."""
    from yuebing.lab.sim_config import SimConfig
    from yuebing.lab.trace import load_trace

    trace = load_trace(data.CONVERSATION_TRACE)
    what_if = one_gpu.scaled(prefill=0.45)
    one = SimConfig(speed=2.0, max_batch=24, slo_tbt_s=0.15, learn_decode_time=True)
    nodes = replace(paper.base_config(paper.mean_context(trace)), speed=2.0, learn_decode_time=True)
    out = {"one_gpu_what_if": _refusals(trace, one, what_if), "paper_instances": _refusals(
        trace, nodes, _predictor_for(one_gpu, trace, gpu))}
    rows = [[a, f"{out['one_gpu_what_if'][a]['refused']:,}", f"{out['paper_instances'][a]['refused']:,}",
             f"{out['paper_instances'][a]['slo_attainment']:.0%}", f"{n:,}"] for a, n in paper.TABLE3_REJECTED.items()]
    print(text_table("Table 3: requests refused at 2× replay, 8P+8D", ["admission", "one GPU, prefill 0.45×",
                     "paper's instances", "(within SLOs)", "paper's"], rows))
    return out


def _refusals(trace: Sequence[TraceRequest], config: SimConfig, predictor: Predictor) -> dict:
    from yuebing.lab.sim import simulate

    runs = {a: simulate(trace, replace(config, admission=a), predictor).result for a in paper.TABLE3_REJECTED}
    return {a: {"refused": r["refused"], "slo_attainment": r["slo_attainment"]} for a, r in runs.items()}


def _pct(x: float) -> str:
    return "∞" if x == float("inf") else f"{x * 100:+.0f} %"


def _plot_path(args: argparse.Namespace, name: str) -> Path | None:
    """Where a figure's PNG goes (None: --plot-dir not given)."""
    if not args.plot_dir:
        return None
    Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
    return Path(args.plot_dir) / name
