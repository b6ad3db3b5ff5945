"""The calibration: its burst, the slowdowns read from its probes, the levelling of
the simulator on the burst, and the whole against the stand-in gateway of
conftest.py. (Against a live cluster: tests/e2e/test_bench.py.)"""

import random
from dataclasses import replace

import pytest

from shared.predictor import Predictor
from yuebing.lab import calibration
from yuebing.lab.calibration import (
    BURST_GROUP_SIZE,
    BURST_GROUPS,
    BesideDecode,
    PrefillAlone,
    calibration_burst,
    level_to_burst,
    prefill_slowdowns,
)
from yuebing.lab.replay import ReplayOptions
from yuebing.lab.sim import simulate
from yuebing.lab.sim_config import HostSharing, SimConfig


def test_the_calibration_burst_is_groups_arriving_at_once_with_fresh_blocks():
    burst = calibration_burst(random.Random(0), long_prompt=2048, block_tokens=128)
    assert len(burst) == BURST_GROUPS * BURST_GROUP_SIZE
    assert len({r.timestamp_ms for r in burst}) == BURST_GROUPS
    assert all(256 <= r.input_length <= 2048 and len(r.hash_ids) * 128 >= r.input_length for r in burst)
    ids = [h for r in burst for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # random prompts: no block shared, no cache helps


def test_prefill_slowdowns_split_a_share_while_decoding_from_a_share_per_stream():
    # 0.1 s of the serving path's overhead and 1 s of prefill alone (before and after
    # the rounds); beside one stream 1.3 s of prefill, beside three 1.5 s.
    alone = PrefillAlone(scale=1.0, overhead_s=0.1, samples=[1.05, 1.1, 1.15])
    beside = BesideDecode({1: [1.4, 1.4], 3: [1.6, 1.6]}, alone=[1.1, 1.1])
    while_decoding, per_stream = prefill_slowdowns(alone, beside, streams=3)
    assert per_stream == pytest.approx(0.1) and while_decoding == pytest.approx(0.2)
    # No more slowdown with more streams: all of it is the share while decoding.
    assert prefill_slowdowns(alone, BesideDecode({1: [1.4], 3: [1.3]}, alone=[1.1]), 3) == pytest.approx((0.3, 0.0))


def test_levelling_to_the_burst_finds_the_prefill_and_decode_speeds_that_reproduce_it():
    predictor = Predictor(prefill_coef=(9.0, 0.1, 1e-5, 1e-6), decode_coef=(4.0, 0.2, 4e-4))
    config = SimConfig(prefill=1, decode=1, policy="round_robin", block_tokens=128, kv_bytes_per_token=0, chunk_tokens=2048)
    burst = calibration_burst(random.Random(1), long_prompt=2048, block_tokens=128)
    # "Live": a cluster whose engines run 1.4× and 1.25× the profile's times.
    truth = HostSharing(prefill_scale=1.4, decode_scale=1.25, decode_slowdown_per_prefill=0.3, first_token_overhead_s=0.02)
    live = simulate(burst, replace(config, host=truth), predictor).outcomes
    found = level_to_burst(replace(truth, prefill_scale=1.0, decode_scale=1.0), burst, live, config, predictor)
    assert found.prefill_scale == pytest.approx(1.4, rel=0.03)
    assert found.decode_scale == pytest.approx(1.25, rel=0.03)


async def test_calibrate_runs_its_experiments_against_a_gateway_and_levels_the_simulator(gateway, monkeypatch):
    # The stand-in (conftest.py) prefills 0.3 ms a token, steps 2 ms, and nothing on
    # it slows anything else; the profile says 0.05 ms a token and 1 ms a step. (A
    # prefill of 150 ms, not 50: this event loop's jitter, beside a 50 ms prefill,
    # once read as a slowdown of more than 1.)
    gateway.prefill_s_per_token, gateway.step_s = 3e-4, 0.002
    monkeypatch.setattr(calibration, "BURST_GROUP_GAP_S", 0.1)  # the burst's groups closer: a quick test
    predictor = Predictor(prefill_coef=(0.0, 0.05, 0.0, 0.0), decode_coef=(1.0, 0.0, 0.0))
    config = SimConfig(prefill=1, decode=1, policy="round_robin", block_tokens=64, kv_bytes_per_token=0)
    host = await calibration.calibrate(gateway.url, ReplayOptions(block_tokens=64, progress=False), predictor, config,
                                       long_prompt=512, streams=2, stream_tokens=40)
    # Milliseconds of overhead, and slowdowns a fraction, not multiples (this event
    # loop serves the stand-in and the client alike: some jitter).
    assert host.first_token_overhead_s < 0.1 and host.step_overhead_s < 0.02
    assert host.prefill_slowdown_while_decoding < 1.0 and host.decode_slowdown_per_prefill < 1.0
    # Levelled: the simulator replays the burst about as the stand-in served it.
    burst = calibration_burst(random.Random(0), 512, 64)
    simulated = simulate(burst, replace(config, host=host), predictor).result
    assert 1.5e-3 < simulated["tbt_mean_s"]["mean"] < 1e-2  # the stand-in steps 2 ms
