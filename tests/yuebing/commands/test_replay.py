"""`yuebing bench replay` and `bench fidelity`: what their flags make of the trace,
the requests and the simulated cluster (the live runs: tests/e2e/test_bench.py)."""

import argparse
import json

import pytest

from yuebing.commands import replay


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="yuebing")
    replay.add_parser(parser.add_subparsers(dest="target", required=True))
    return parser.parse_args(list(argv))


def test_the_trace_is_scaled_to_the_small_model_and_its_blocks_with_it():
    args = parse("replay", "--trace", "conversation", "--limit", "20", "--speed", "2", "--length-factor", "0.25",
                 "--max-input", "1024", "--max-output", "32", "--slo-ttft-ms", "800", "--prompt-seed", "7")
    trace = replay.replay_trace(args)
    assert len(trace) == 20 and max(r.input_length for r in trace) <= 1024 and max(r.output_length for r in trace) <= 32
    assert all(len(r.hash_ids) * 128 >= r.input_length for r in trace)  # 512-token blocks became 128-token ones
    options = replay.replay_options(args)
    assert (options.block_tokens, options.slo_ttft_ms, options.salt) == (128, 800.0, 7)


def test_fidelity_simulates_the_live_cluster_from_its_profile(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"meta": {"kv_bytes_per_token": 4096, "transfer_GBps": 2.5}, "rows": []}))
    args = parse("fidelity", "--synthetic", "10", "--prefill", "2", "--pool-blocks", "512", "--profile", str(profile))
    config, path = replay.fidelity_sim_config(args, block_tokens=128)
    assert path == profile
    assert (config.prefill, config.decode, config.policy, config.pool_blocks) == (2, 1, "round_robin", 512)
    assert (config.kv_bytes_per_token, config.bandwidth_gbps, config.block_tokens) == (4096, 2.5, 128)


def test_fidelity_repeats_at_least_once():
    with pytest.raises(SystemExit):
        parse("fidelity", "--synthetic", "10", "--repeats", "0")
