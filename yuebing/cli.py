"""The `yuebing` command: model init, up (and later: profile, sim, bench)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shared.config import DEFAULT_PROFILE, ClusterConfig


def _model_init(args: argparse.Namespace) -> int:
    from yuebing.model import ModelSpec, write_model

    spec = ModelSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        max_position=args.max_position,
        seed=args.seed,
        dtype=args.dtype,
    )
    out = Path(args.out)
    if args.if_missing and (out / "config.json").exists():
        print(f"model already at {out}")
        return 0
    write_model(spec, out, overwrite=args.force)
    print(f"wrote {out}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from yuebing.launcher import UpOptions, up

    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        print(f"no model at {model}: run `yuebing model init --out {args.model}` first", file=sys.stderr)
        return 2
    config = ClusterConfig(
        model=str(model),
        model_name=args.model_name or model.name,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_gib=args.kv_cache_gib,
        request_timeout_s=args.request_timeout,
        policy=args.policy,
        admission=args.admission,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tbt_ms=args.slo_tbt_ms,
        profile=str(Path(args.profile).resolve()) if args.profile else "",
        decode_time_s=args.decode_time,
        log_level=args.log_level,
    )
    options = UpOptions(
        config=config,
        prefill=args.prefill,
        decode=args.decode,
        nodes=args.nodes,
        host=args.host,
        port=args.port,
        nats_port=args.nats_port,
        api_key=args.api_key,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        ready_file=Path(args.ready_file) if args.ready_file else None,
    )
    return up(options)


def _profile(args: argparse.Namespace) -> int:
    from yuebing.profile import Grid, profile

    grid = Grid(repeats=args.repeats)
    meta = profile(Path(args.model), Path(args.out), grid, args.max_model_len)
    errors = meta["held_out_mape_percent"]
    print(f"wrote {args.out} in {meta['seconds']:.0f}s")
    print(f"held-out error (MAPE): prefill {errors['prefill']:.1f} %, decode step {errors['decode']:.1f} %")
    print(f"KV bytes per token {meta['kv_bytes_per_token']}, transport {meta['transfer_GBps']:.2f} GB/s")
    return 0


def _bench_conductor(args: argparse.Namespace) -> int:
    from yuebing.bench import ConductorBench, print_conductor, run_conductor, write_json

    cfg = ConductorBench(
        sizes=tuple(args.sizes), indexed_blocks=args.blocks, decisions=args.decisions, policy=args.policy, admission=args.admission
    )
    result = run_conductor(cfg)
    print_conductor(result)
    write_json(result, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from services.conductor.policy import ADMISSIONS, PREFILL_POLICIES
    from yuebing.model import ModelSpec, default_model_dir

    d = ModelSpec()
    p = argparse.ArgumentParser(prog="yuebing", description="Yuebing: KVCache-centric disaggregated LLM serving")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="action", required=True)
    init = model.add_parser("init", help="write a seeded-random LLaMA-architecture model with a byte-level tokenizer")
    init.add_argument("--out", default=str(default_model_dir()))
    init.add_argument("--layers", type=int, default=d.layers)
    init.add_argument("--hidden", type=int, default=d.hidden)
    init.add_argument("--heads", type=int, default=d.heads)
    init.add_argument("--kv-heads", type=int, default=d.kv_heads)
    init.add_argument("--intermediate", type=int, default=d.intermediate)
    init.add_argument("--max-position", type=int, default=d.max_position)
    init.add_argument("--seed", type=int, default=d.seed)
    init.add_argument("--dtype", default=d.dtype)
    init.add_argument("--force", action="store_true", help="overwrite an existing folder")
    init.add_argument("--if-missing", action="store_true", help="do nothing if a model is already there")
    init.set_defaults(func=_model_init)

    prof = sub.add_parser("profile", help="measure the engine and fit the Conductor's time models")
    prof.add_argument("--model", default=str(default_model_dir()))
    prof.add_argument("--out", default=str(DEFAULT_PROFILE))
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--max-model-len", type=int, default=4096)
    prof.set_defaults(func=_profile)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="target", required=True)
    bc = bench.add_parser("conductor", help="Conductor decisions per second and latency")
    bc.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256], help="instance counts")
    bc.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the index")
    bc.add_argument("--decisions", type=int, default=3000)
    bc.add_argument("--policy", default="kvcentric")
    bc.add_argument("--admission", default="predictive")
    bc.add_argument("--json", help="also write the result here")
    bc.set_defaults(func=_bench_conductor)

    c = ClusterConfig()
    upp = sub.add_parser("up", help="run the local cluster (Ctrl-C stops it)")
    upp.add_argument("--model", default=str(default_model_dir()))
    upp.add_argument("--model-name", default="", help="name served by the API (default: the folder name)")
    upp.add_argument("--prefill", type=int, default=1, help="prefill instances")
    upp.add_argument("--decode", type=int, default=1, help="decode instances")
    upp.add_argument("--nodes", type=int, default=1, help="nodes (one messenger each)")
    upp.add_argument("--host", default="127.0.0.1")
    upp.add_argument("--port", type=int, default=8000)
    upp.add_argument("--nats-port", type=int, default=0, help="0: a free port")
    upp.add_argument("--api-key", default=os.environ.get("YUEBING_API_KEY"))
    upp.add_argument("--max-model-len", type=int, default=c.max_model_len)
    upp.add_argument("--block-size", type=int, default=c.block_size, help="tokens per pool block")
    upp.add_argument("--kv-cache-gib", type=int, default=c.kv_cache_gib, help="KV cache per engine (CPU)")
    upp.add_argument("--request-timeout", type=float, default=c.request_timeout_s, help="seconds")
    upp.add_argument("--policy", default=c.policy, choices=PREFILL_POLICIES, help="prefill scheduling policy")
    upp.add_argument("--admission", default=c.admission, choices=ADMISSIONS, help="early rejection mode")
    upp.add_argument("--slo-ttft-ms", type=float, default=c.slo_ttft_ms, help="default TTFT SLO")
    upp.add_argument("--slo-tbt-ms", type=float, default=c.slo_tbt_ms, help="default TBT SLO")
    upp.add_argument("--profile", default="", help="time-model profile (default: the shipped one)")
    upp.add_argument("--decode-time", type=float, default=c.decode_time_s, help="predictive admission's t_d, s")
    upp.add_argument("--log-level", default=c.log_level)
    upp.add_argument("--run-dir", help="where logs and the config go (default: a new temp dir)")
    upp.add_argument("--ready-file", help="write a JSON with the URL and pids once ready")
    upp.set_defaults(func=_up)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError) as e:
        print(f"yuebing: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
