"""The `yuebing` command: model init, up (and later: profile, sim, bench)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from shared.config import DEFAULT_PROFILE, REQUEST_TIMEOUT_S, ClusterConfig

# GPU-measured curves beside the repo (../shared/profiles), for simulating GPU clusters.
DEFAULT_SIM_PROFILE = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "h100-dense-llama.json"


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
        pool_bytes=args.pool_mib << 20,
        eviction=args.eviction,
        ssd_dir=str(Path(args.ssd_dir).resolve()) if args.ssd_dir else "",
        ssd_bytes=args.ssd_mib << 20,
        kv_wait_s=args.kv_wait,
        kv_stream_layers=not args.no_kv_streaming,
        engine_prefix_caching=not args.no_engine_prefix_cache,
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


def _bench_transfer(args: argparse.Namespace) -> int:
    from yuebing import transfer_bench
    from yuebing.bench import write_json

    sizes = [int(k) * 1024 for k in args.sizes_kib]
    print(f"messenger → messenger over ZeroMQ TCP loopback, {args.total_mib} MiB per block size:")
    results = transfer_bench.run(sizes, args.total_mib << 20)
    print(transfer_bench.table(results))
    write_json(transfer_bench.to_json(results), args.json)
    return 0


def _bench_ttft(args: argparse.Namespace) -> int:
    from yuebing import ttft_bench
    from yuebing.bench import write_json

    results = ttft_bench.run(Path(args.model).resolve(), args.prompt_tokens, args.repeats, args.max_model_len)
    print(ttft_bench.table(results, args.prompt_tokens))
    write_json(ttft_bench.to_json(results, args.prompt_tokens), args.json)
    return 0


def _bench_reuse(args: argparse.Namespace) -> int:
    from yuebing import reuse_bench
    from yuebing.bench import write_json

    results = reuse_bench.run(Path(args.model).resolve(), args.prompt_tokens, args.repeats, args.max_model_len)
    print(reuse_bench.table(results, args.prompt_tokens))
    write_json(reuse_bench.to_json(results, args.prompt_tokens), args.json)
    return 0


def _sim(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from shared.predictor import load_predictor
    from yuebing import sim

    trace = _load_trace(args)
    predictor = load_predictor(args.profile, args.profile_model or None)
    if args.prefill_time_scale != 1.0:  # a what-if on the profile: the Conductor and the instances alike see it
        predictor = replace(predictor, prefill_coef=tuple(c * args.prefill_time_scale for c in predictor.prefill_coef))
    base = sim.SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        slo_ttft_s=args.slo_ttft_ms / 1e3,
        slo_tbt_s=args.slo_tbt_ms / 1e3,
        slo_ttft_x=args.slo_ttft_x,
        slo_tbt_x=args.slo_tbt_x,
        pool_blocks=args.pool_blocks,
        kv_bytes_per_token=args.kv_bytes_per_token,
        bandwidth_gbps=args.bandwidth_gbps,
        layerwise=not args.no_layerwise,
        chunk_tokens=args.chunk_tokens,
        max_batch=args.max_batch,
        decode_time_s=args.decode_time,
        learn_decode_time=args.learn_decode_time,
        request_timeout_s=args.request_timeout,
        speed=args.speed,
        seed=args.seed,
    )
    policies, admissions = args.policy.split(","), args.admission.split(",")
    configs = [replace(base, policy=p, admission=a) for p in policies for a in admissions]
    if args.pd_total:  # P:D sweep at a fixed total, for the first policy/admission
        configs = [replace(configs[0], prefill=p, decode=args.pd_total - p) for p in range(1, args.pd_total)]
    if args.find_capacity:
        found = [sim.find_capacity(trace, c, predictor, target=args.target) for c in configs]
        print(f"highest replay speed with ≥ {args.target:.0%} of requests within both SLOs:")
        for f in found:
            print(f"  {f['policy']:>14}/{f['admission']:<13} speed {f['capacity_speed']:.3f}×  ({f.get('capacity_rps', 0):.2f} req/s)")
        output: dict = {"trace": args.trace if not args.synthetic else "synthetic", "capacity": found}
    else:
        runs = sim.compare(trace, configs, predictor)
        print(f"{len(trace)} requests, {args.prefill} prefill + {args.decode} decode, speed {args.speed}×")
        print(sim.table([r.result for r in runs]))
        if args.pd_total:
            best = max(runs, key=lambda r: r.result["goodput_rps"]).result
            print(f"goodput peaks at {best['prefill']} prefill : {best['decode']} decode ({best['goodput_rps']:.2f} req/s)")
        output = {"trace": args.trace if not args.synthetic else "synthetic", "config": vars(args) | {"func": None},
                  "runs": [r.result for r in runs]}
        if args.plot_dir:
            for path in sim.plot(runs, args.plot_dir):
                print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=1, default=str) + "\n")
    return 0


def _load_trace(args: argparse.Namespace) -> list:
    """--trace FILE (optionally --limit), or --synthetic N (see _trace_flags)."""
    from yuebing.trace import SyntheticSpec, load_trace, synthetic

    if args.synthetic:
        spec = SyntheticSpec(requests=args.synthetic, rate_per_s=args.rate, input_mean=args.input_mean,
                             output_mean=args.output_mean, seed=args.seed)
        return synthetic(spec)
    return load_trace(args.trace, args.limit)


def _trace_flags(p: argparse.ArgumentParser) -> None:
    """Where requests come from, for the simulator and the live benchmarks alike."""
    from yuebing.trace import SyntheticSpec

    d = SyntheticSpec()
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace in Mooncake's JSONL format")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic requests instead (Poisson arrivals)")
    p.add_argument("--rate", type=float, default=d.rate_per_s, help="synthetic arrivals per second")
    p.add_argument("--input-mean", type=int, default=d.input_mean, help="synthetic prompt tokens")
    p.add_argument("--output-mean", type=int, default=d.output_mean, help="synthetic output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--json", help="also write the result here")


def _replay_trace(args: argparse.Namespace) -> list:
    """The trace a live run replays, scaled to the small model."""
    from yuebing.trace import rescale

    return rescale(_load_trace(args), speed=args.speed, length_factor=args.length_factor, max_input=args.max_input,
                   max_output=args.max_output)


def _replay_options(args: argparse.Namespace):
    from yuebing.replay import ReplayOptions
    from yuebing.trace import TRACE_BLOCK_TOKENS

    return ReplayOptions(
        model=args.model_name, block_tokens=round(TRACE_BLOCK_TOKENS * args.length_factor), slo_ttft_ms=args.slo_ttft_ms,
        slo_tbt_ms=args.slo_tbt_ms, api_key=args.api_key, salt=args.prompt_seed,
    )


def _bench_replay(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from yuebing.metrics import summarize
    from yuebing.replay import replay
    from yuebing.sim import plot_cdfs

    trace = _replay_trace(args)
    outcomes, wall = asyncio.run(replay(args.url, trace, _replay_options(args)))
    result = summarize(outcomes, wall)
    ttft, tbt = result["ttft_s"], result["tbt_s"]
    print(f"{len(trace)} requests against {args.url} in {wall:.1f}s")
    print(f"TTFT ms mean {ttft['mean'] * 1e3:.1f}  p50 {ttft['p50'] * 1e3:.1f}  p90 {ttft['p90'] * 1e3:.1f}  p99 {ttft['p99'] * 1e3:.1f}")
    print(f"TBT  ms mean {tbt['mean'] * 1e3:.2f}  p50 {tbt['p50'] * 1e3:.2f}  p90 {tbt['p90'] * 1e3:.2f}  p99 {tbt['p99'] * 1e3:.2f}")
    print(f"completed {result['completed']}  rejected (429) {result['rejected']}  failed {result['failed']}  "
          f"SLO attainment {result['slo_attainment']:.3f}  goodput {result['goodput_rps']:.2f}/s  "
          f"cache hit rate {result['cache_hit_rate']:.3f}")
    if args.plot_dir:
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        print("wrote", plot_cdfs({"live": outcomes}, str(Path(args.plot_dir) / "cdf.png")))
    if args.json:
        Path(args.json).write_text(json.dumps({"url": args.url, "trace": args.trace or "synthetic", "speed": args.speed,
                                               "length_factor": args.length_factor, **result}, indent=1) + "\n")
    return 0 if result["failed"] == 0 else 1


def _fidelity_sim_config(args: argparse.Namespace, options):
    """The live cluster as the simulator sees it, and the live profile's path."""
    import json

    from shared.config import profile_path
    from yuebing.sim import SimConfig

    profile = Path(args.profile) if args.profile else profile_path(ClusterConfig())
    meta = json.loads(profile.read_text())["meta"]
    config = SimConfig(
        prefill=args.prefill, decode=args.decode, policy=args.policy, block_tokens=options.block_tokens,
        pool_blocks=args.pool_blocks, kv_bytes_per_token=meta["kv_bytes_per_token"], bandwidth_gbps=meta["transfer_GBps"],
        chunk_tokens=ClusterConfig().step_tokens, slo_ttft_s=1e9, slo_tbt_s=1e9,
    )
    return config, profile


def _print_compare(compare: dict, indent: str) -> None:
    for key, c in compare.items():
        print(f"{indent}{key:>12}: live {c['live'] * 1e3:8.2f} ms   sim {c['sim'] * 1e3:8.2f} ms   sim/live {c['sim_over_live']:.3f}")


def _bench_fidelity(args: argparse.Namespace) -> int:
    import json

    from shared.predictor import load_predictor
    from yuebing.replay import fidelity

    trace = _replay_trace(args)
    options = _replay_options(args)
    config, profile = _fidelity_sim_config(args, options)
    run = fidelity(args.url, trace, options, config, load_predictor(profile), repeats=args.repeats)
    result = run.result
    for i, r in enumerate(result["runs"]):
        h = r["host"]
        print(f"run {i + 1}: host sharing (calibrated live): prefill ×{h['prefill_scale']:.2f} the profile, "
              f"+{h['prefill_slowdown_while_decoding']:.1%} while decoding and +{h['prefill_slowdown_per_decoding']:.1%} per "
              f"request decoding; decode ×{h['decode_scale']:.2f} the profile, step +{h['step_overhead_s'] * 1e3:.2f} ms, "
              f"+{h['decode_slowdown_per_prefill']:.1%} per prefill running; first-token overhead "
              f"{h['first_token_overhead_s'] * 1e3:.1f} ms, hand-off {h['handoff_s'] * 1e3:.1f} ms, join step "
              f"+{h['join_step_s'] * 1e3:.1f} ms, join overhead {h['join_overhead_s'] * 1e3:.1f} ms")
        print("  live decode gaps by streams decoding / a prefill waiting (mean ms, gaps): "
              + ", ".join(f"{k} {g['mean_ms']:.1f} ({g['gaps']})" for k, g in r["live_decode_gaps"].items()))
        _print_compare(r["compare"], "  ")
    if len(result["runs"]) > 1:
        print(f"over the {len(result['runs'])} runs (means of the runs' means):")
        _print_compare(result["compare"], "")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.plot_dir:
        from yuebing.replay import plot_pairs
        from yuebing.sim import plot_cdfs

        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        print("wrote", plot_cdfs({"live": run.live, "simulated": run.simulated}, str(Path(args.plot_dir) / "fidelity_cdf.png")))
        print("wrote", plot_pairs(run, str(Path(args.plot_dir) / "fidelity_pairs.png")))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _live_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by the benchmarks that replay a trace against a live gateway."""
    p.add_argument("--url", default="http://127.0.0.1:8000")
    _trace_flags(p)
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    p.add_argument("--length-factor", type=float, default=0.25, help="scale lengths (and 512-token blocks) by this")
    p.add_argument("--max-input", type=int, default=2048)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--model-name", default="yuebing-tiny")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="sent as x-yuebing-slo-ttft-ms (0: cluster default)")
    p.add_argument("--slo-tbt-ms", type=float, default=0.0, help="sent as x-yuebing-slo-tbt-ms (0: cluster default)")
    p.add_argument("--api-key", default=os.environ.get("YUEBING_API_KEY"))
    p.add_argument("--prompt-seed", type=int, default=int(time.time()),
                   help="salt of the prompt tokens (default: now, so nothing is cached from an earlier run)")


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
    bt = bench.add_parser("transfer", help="messenger→messenger throughput vs memcpy, per block size")
    bt.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384], help="block sizes, KiB")
    bt.add_argument("--total-mib", type=int, default=256, help="bytes moved per block size, MiB")
    bt.add_argument("--json", help="also write the result here")
    bt.set_defaults(func=_bench_transfer)
    btt = bench.add_parser("ttft", help="TTFT of a long prompt: colocated vLLM vs disaggregated, streaming on/off")
    btt.add_argument("--model", default=str(default_model_dir()))
    btt.add_argument("--prompt-tokens", type=int, default=2048)
    btt.add_argument("--repeats", type=int, default=11, help="prompts per deployment (medians are reported)")
    btt.add_argument("--max-model-len", type=int, default=4096)
    btt.add_argument("--json", help="also write the result here")
    btt.set_defaults(func=_bench_ttft)
    bru = bench.add_parser("reuse", help="TTFT with 0/50/90 %% of the prompt cached locally, and 90 %% on another node")
    bru.add_argument("--model", default=str(default_model_dir()))
    bru.add_argument("--prompt-tokens", type=int, default=2048)
    bru.add_argument("--repeats", type=int, default=7)
    bru.add_argument("--max-model-len", type=int, default=4096)
    bru.add_argument("--json", help="also write the result here")
    bru.set_defaults(func=_bench_reuse)
    br = bench.add_parser("replay", help="replay a trace against a live gateway (streaming)")
    _live_flags(br)
    br.add_argument("--plot-dir", help="write TTFT/TBT CDFs here")
    br.set_defaults(func=_bench_replay)
    bf = bench.add_parser("fidelity", help="the same trace live and in the simulator: mean TTFT and TBT")
    _live_flags(bf)
    bf.add_argument("--prefill", type=int, default=1, help="the live cluster's prefill instances")
    bf.add_argument("--decode", type=int, default=1, help="the live cluster's decode instances")
    bf.add_argument("--policy", default="round_robin", help="the live cluster's policy")
    bf.add_argument("--pool-blocks", type=int, default=2048, help="prefix-cache blocks per prefill engine")
    bf.add_argument("--profile", default="", help="the live profile (default: the shipped one)")
    bf.add_argument("--plot-dir", default="", help="write TTFT/TBT CDFs and per-request live-vs-sim plots here")
    bf.add_argument("--repeats", type=_positive_int, default=1,
                    help="calibrate and replay this many times (fresh prompts each) and compare the means over the runs")
    bf.set_defaults(func=_bench_fidelity)

    sp = sub.add_parser("sim", help="simulate a cluster replaying a trace (policies from the Conductor)")
    _trace_flags(sp)
    sp.add_argument("--profile", default=str(DEFAULT_SIM_PROFILE), help="timing profile (rows of measured times)")
    sp.add_argument("--profile-model", default="llama3-8b", help="rows of this model (empty: all)")
    sp.add_argument("--prefill", type=int, default=8)
    sp.add_argument("--decode", type=int, default=8)
    sp.add_argument("--policy", default="kvcentric", help="one name, or several comma-separated to compare")
    sp.add_argument("--admission", default="none", help="one name, or several comma-separated to compare")
    sp.add_argument("--compare", action="store_true", help="(the table compares every policy × admission given)")
    sp.add_argument("--find-capacity", action="store_true", help="binary-search the highest replay speed meeting --target")
    sp.add_argument("--target", type=float, default=0.9, help="share of requests within both SLOs")
    sp.add_argument("--pd-total", type=int, default=0, help="sweep prefill:decode splits of this many instances")
    sp.add_argument("--speed", type=float, default=1.0, help="replay speed factor")
    sp.add_argument("--slo-ttft-ms", type=float, default=30_000.0)
    sp.add_argument("--slo-tbt-ms", type=float, default=100.0)
    sp.add_argument("--slo-ttft-x", type=float, default=0.0, help="TTFT SLO as a multiple of the unloaded prefill time")
    sp.add_argument("--slo-tbt-x", type=float, default=0.0, help="TBT SLO as a multiple of the unloaded step time")
    sp.add_argument("--pool-blocks", type=int, default=20_000, help="KV blocks per prefill instance's DRAM share")
    sp.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    sp.add_argument("--bandwidth-gbps", type=float, default=25.0, help="node-to-node KV bandwidth, GB/s")
    sp.add_argument("--no-layerwise", action="store_true", help="send KV only after the last layer")
    sp.add_argument("--chunk-tokens", type=int, default=0, help="a prefill step's token budget, as vLLM's chunked prefill (0: a whole prompt a step)")
    sp.add_argument("--max-batch", type=int, default=128, help="decode batch limit")
    sp.add_argument("--prefill-time-scale", type=float, default=1.0,
                    help="what-if: the profile's prefill times × this (e.g. 0.5: instances prefill twice as fast)")
    sp.add_argument("--decode-time", type=float, default=10.0, help="predictive admission's t_d, s")
    sp.add_argument("--learn-decode-time", action="store_true",
                    help="learn t_d from completed decodes, starting at --decode-time (as the live Conductor does)")
    sp.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                    help="a client with no first token after this many s gives up (0: never), as the live gateway's deadline")
    sp.add_argument("--plot-dir", help="write PNG plots here")
    sp.set_defaults(func=_sim)

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
    upp.add_argument("--pool-mib", type=int, default=c.pool_bytes >> 20, help="each node's KV block pool, MiB")
    upp.add_argument("--eviction", default=c.eviction, choices=("lru", "lfu"), help="node pools' eviction policy")
    upp.add_argument("--ssd-dir", default="", help="SSD tier: each node keeps evicted blocks in DIR/<node>")
    upp.add_argument("--ssd-mib", type=int, default=0, help="SSD tier size per node, MiB")
    upp.add_argument("--no-engine-prefix-cache", action="store_true",
                     help="turn vLLM's own prefix cache off: all reuse goes through the node pools")
    upp.add_argument("--kv-wait", type=float, default=c.kv_wait_s, help="seconds decode waits for blocks in transit")
    upp.add_argument("--no-kv-streaming", action="store_true",
                     help="send a block after its last layer instead of layer by layer (for comparison)")
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
