"""`yuebing sim-long-context`: long prompts on a pool of prefill instances in the
simulator (yuebing/lab/long_context.py): plain single-instance prefill, Mooncake's
chunked pipeline parallelism (CPP groups of S stages) and LoongServe's elastic
sequence parallelism (ESP), in TTFT and in instance-seconds per request, one prompt
at a time and under load; then where each wins, from the numbers.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from yuebing.commands import add_json_flag, text_table, write_json
from yuebing.lab import data

if TYPE_CHECKING:
    from yuebing.lab.long_context import Setup

GROUP = None

LENGTHS = "8192,16384,32768,65536,131072"
# (load, metric, what the summary calls it)
WINS = (("lone", "ttft_mean_s", "TTFT alone"), ("loaded", "ttft_mean_s", "mean TTFT loaded"),
        ("loaded", "ttft_p90_s", "p90 TTFT loaded"), ("lone", "instance_s", "instance-s alone"),
        ("loaded", "instance_s", "instance-s loaded"))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-long-context", help="simulate long prompts: single-instance prefill, CPP groups and "
                              "elastic sequence parallelism, in TTFT and instance-seconds")
    p.add_argument("--profile", default=str(data.GPU_PROFILE), help="timing profile (default: an H100's, shipped in "
                   "yuebing/lab/data)")
    p.add_argument("--profile-model", default="llama3-8b", help="rows of this model: llama3-8b or llama2-70b (their "
                   "hidden size and KV bytes per token are known)")
    p.add_argument("--instances", type=int, default=8, help="prefill instances in the pool")
    p.add_argument("--lengths", default=LENGTHS, help="input lengths, tokens, comma-separated")
    # 8192: vLLM's default step budget for its server on large GPUs, and the largest
    # chunk the profile measured over a long cached prefix (8,192 over 24,576).
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk, tokens (single and CPP)")
    p.add_argument("--stages", default="2,4,8", help="CPP group sizes, comma-separated (instances // S groups of "
                   "each; a size over --instances is left out)")
    p.add_argument("--link-gbps", type=float, default=25.0, help="link between instances, GB/s (CPP's stage "
                   "boundary and ESP's ring; 25: a 200 Gbps RDMA NIC, as `yuebing sim`'s KV link)")
    p.add_argument("--esp-max", type=int, default=0, help="most instances one ESP prompt takes (0: all)")
    p.add_argument("--load", type=float, default=0.7, help="loaded rate, as a fraction of single's capacity "
                   "(instances / single's prefill time)")
    p.add_argument("--requests", type=int, default=400, help="prompts in the loaded run")
    p.add_argument("--seed", type=int, default=0, help="seed of the loaded run's Poisson arrivals")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.predictor import load_predictor, read_rows
    from yuebing.lab.long_context import study

    setup, stages = _setup(args), _ints(args.stages)  # first: its errors say what to pass
    predictor = load_predictor(args.profile, args.profile_model)
    measured = max(r.n + r.p for r in read_rows(args.profile, args.profile_model) if r.phase == "prefill")
    rows = study(predictor, setup, _ints(args.lengths), stages, args.load, args.requests, args.seed)
    print(_header(args, measured))
    for text in _tables(rows):
        print(text)
    wins = _wins(rows)
    print("where each wins: " + "; ".join(f"{label}: {text}" for label, text in wins.items()))
    write_json({"config": vars(args) | {"func": None}, "profile_measured_tokens": measured, "rows": rows,
                "wins": wins}, args.json)
    return 0


def _setup(args: argparse.Namespace) -> Setup:
    from yuebing.lab.long_context import Setup
    from yuebing.shapes import SHAPES

    if args.profile_model not in SHAPES:
        raise ValueError(f"--profile-model must be one of {', '.join(SHAPES)} (its shape sizes the transfers)")
    if args.instances < 1 or args.requests < 1 or args.load <= 0:
        raise ValueError("--instances, --requests and --load must be positive")
    return Setup(SHAPES[args.profile_model], args.instances, args.chunk, args.link_gbps * 1e9, args.esp_max)


def _header(args: argparse.Namespace, measured: int) -> str:
    return (f"{args.profile_model} on {args.instances} prefill instances, chunks of {args.chunk} tokens, links "
            f"{args.link_gbps:g} GB/s; the profile measured prompts up to {measured:,} tokens, longer ones "
            "extrapolate its fitted quadratic; prefill only (no decode beside it, no KV transfer to decode)")


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _tables(rows: list[dict]) -> list[str]:
    names = list(rows[0]["lone"])
    lone_ttft = [[_k(r["tokens"])] + [f"{r['lone'][n]['ttft_mean_s']:.2f}" for n in names] for r in rows]
    lone_inst = [[_k(r["tokens"])] + [f"{r['lone'][n]['instance_s']:.2f}" for n in names] for r in rows]
    loaded_ttft = [[_k(r["tokens"]), f"{r['rate_per_s']:.3g}"]
                   + [f"{r['loaded'][n]['ttft_mean_s']:.2f}/{r['loaded'][n]['ttft_p90_s']:.2f}" for n in names]
                   for r in rows]
    loaded_inst = [[_k(r["tokens"])] + [f"{r['loaded'][n]['instance_s']:.2f}" for n in names]
                   + [f"{r['loaded']['esp']['degree_mean']:.1f}"] for r in rows]
    link = [[_k(r["tokens"])] + [f"{r['loaded'][n]['link_gb']:.1f}" for n in names] for r in rows]
    return [
        text_table("one prompt at a time: TTFT, s", ["input", *names], lone_ttft),
        text_table("one prompt at a time: instance-seconds per request", ["input", *names], lone_inst),
        text_table("loaded (Poisson at the rate shown): TTFT mean/p90, s", ["input", "req/s", *names], loaded_ttft),
        text_table("loaded: instance-seconds per request (esp D: its mean instances)", ["input", *names, "esp D"],
               loaded_inst),
        text_table("loaded: GB each request sends between instances (CPP: activations at stage boundaries; ESP: "
               "KV blocks round the ring)", ["input", *names], link),
    ]


def _wins(rows: list[dict]) -> dict[str, str]:
    """Per comparison, the least strategy and the input lengths where it is least."""
    from yuebing.lab.long_context import winners

    out = {}
    for load, metric, label in WINS:
        runs = winners(rows, load, metric)
        out[label] = ", ".join(f"{name} {_span(lengths)}" for name, lengths in runs)
    return out


def _span(lengths: list[int]) -> str:
    return _k(lengths[0]) if len(lengths) == 1 else f"{_k(lengths[0])}–{_k(lengths[-1])}"
