"""`yuebing bench replay` against the live cluster: real requests, real prefix sharing."""

import asyncio

import pytest

from yuebing.lab.outcome import summarize
from yuebing.lab.replay import ReplayOptions, replay
from yuebing.lab.trace import SyntheticSpec, rescale, synthetic

pytestmark = pytest.mark.e2e


def test_replay_measures_every_request_and_shared_prefixes_hit(cluster):
    spec = SyntheticSpec(requests=8, rate_per_s=4.0, input_mean=2048, output_mean=64, shared_prefix_ratio=1.0, prefixes=1,
                         prefix_share_of_input=0.5, length_sigma=0.1, seed=5)
    trace = rescale(synthetic(spec), length_factor=0.25, max_input=900, max_output=24)
    outcomes, wall = asyncio.run(replay(cluster.url, trace, ReplayOptions(block_tokens=128, progress=False, salt=11)))
    assert all(o.completed for o in outcomes), outcomes
    for o in outcomes:
        assert 0 < o.ttft_s and o.tbt_mean_s > 0
    # Every request starts with the same 2-block prefix; all but the first find it cached.
    assert sum(o.cached_tokens >= 256 for o in outcomes[1:]) >= len(outcomes) - 2
    result = summarize(outcomes, wall)
    assert result["completed"] == 8 and result["cache_hit_rate"] > 0.1


def test_requests_of_one_timestamp_are_served_in_trace_order(cluster):
    # The simulator serves a group that arrives at once in trace order; so must the
    # replay send it (tasks sleeping to one instant used to wake shuffled).
    from yuebing.lab.trace import TraceRequest

    trace = [TraceRequest(300.0, 200 + 60 * i, 2, (1000 + 2 * i, 1001 + 2 * i)) for i in range(6)]
    outcomes, _ = asyncio.run(replay(cluster.url, trace, ReplayOptions(block_tokens=128, progress=False, salt=12)))
    firsts = [o.token_times[0] for o in outcomes]
    assert all(a <= b + 0.002 for a, b in zip(firsts, firsts[1:])), firsts


async def _probe_and_calibrate(url, predictor, config):
    """The TTFT probe alone (its scale read straight off two prompt lengths), then the
    whole calibration, levelled on its burst."""
    from yuebing.lab.calibration import ProbeSizes, Prober, calibrate, prefill_alone
    from yuebing.lab.replay import connect

    options = ReplayOptions(progress=False)
    async with connect(options) as session:
        prober = Prober(session, url, options, ProbeSizes(long_prompt=512, streams=2, stream_tokens=400))
        await prober.first_token(512)  # warm-up
        alone = await prefill_alone(prober, predictor)
    host = await calibrate(url, options, predictor, config, long_prompt=512, streams=2, stream_tokens=400)
    return alone, host


def test_calibration_measures_the_serving_path_against_the_profile(cluster):
    from shared.config import ClusterConfig, profile_path
    from shared.predictor import load_predictor
    from yuebing.lab.sim_config import SimConfig

    predictor = load_predictor(profile_path(ClusterConfig()))
    config = SimConfig(prefill=1, decode=1, policy="round_robin", block_tokens=128, kv_bytes_per_token=0,
                       chunk_tokens=ClusterConfig().step_tokens)
    alone, host = asyncio.run(_probe_and_calibrate(cluster.url, predictor, config))
    # How fast this host runs the shipped profile's curves is the host's affair (1-2x
    # where the profile was taken, 3.3-4.2x on slower 2-core hosts); what calibration
    # owes is agreement: levelled on the burst, the prefill scale stays within a small
    # factor of the one read off lone prompts, behind a serving path that costs
    # milliseconds, not seconds. (calibrate clamps the low ends.) A factor of 4: CI's
    # host once read 3.15 (0.51 alone, 1.60 on the burst), its burst beside a busy core.
    assert alone.scale / 4 < host.prefill_scale < alone.scale * 4, (alone, host)
    assert host.first_token_overhead_s < 0.5 and host.step_overhead_s < 0.05
    # Two engines sharing two cores slow each other by a share, not by multiples. On
    # 512-token probes the split between the slowdown while anything decodes and the
    # share per stream is a difference of two noisy medians: 1.17 and 1.30 were
    # measured on one host, so the bound is "not by multiples".
    assert host.prefill_slowdown_per_decoding < 3.0 and host.decode_slowdown_per_prefill < 3.0
    assert host.prefill_slowdown_while_decoding < 3.0
    assert host.join_overhead_s < 0.2  # a join's set-up beside a prefill: milliseconds
    # Decode, levelled on the burst, runs the profile's curves within a small factor
    # (this cluster's settings, 1,024-token context and two nodes, read x0.195-0.24);
    # handing a request to decode and its join step cost milliseconds.
    assert 0.1 < host.decode_scale < 3.0
    assert host.handoff_s < 0.2 and host.join_step_s < 0.2
