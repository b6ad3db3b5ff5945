from dataclasses import replace

import pytest

from yuebing.replay import prompt_tokens
from yuebing.trace import TraceRequest


def test_equal_hash_ids_give_equal_token_blocks():
    a = prompt_tokens(TraceRequest(0, 300, 1, (7, 8, 9)), block_tokens=128)
    b = prompt_tokens(TraceRequest(0, 256, 1, (7, 8)), block_tokens=128)
    c = prompt_tokens(TraceRequest(0, 256, 1, (7, 5)), block_tokens=128)
    assert len(a) == 300 and len(b) == 256
    assert a[:256] == b  # shared prefix, token for token
    assert c[:128] == b[:128] and c[128:] != b[128:]
    assert all(32 <= t < 127 for t in a)


def test_the_salt_gives_fresh_prompts_with_the_same_sharing():
    r1, r2 = TraceRequest(0, 256, 1, (1, 2)), TraceRequest(0, 256, 1, (1, 3))
    assert prompt_tokens(r1, 128, salt=1) != prompt_tokens(r1, 128, salt=2)
    assert prompt_tokens(r1, 128, salt=2)[:128] == prompt_tokens(r2, 128, salt=2)[:128]


def test_fidelity_pairs_plot_is_a_png(tmp_path):
    from yuebing.metrics import Outcome
    from yuebing.replay import Fidelity, plot_pairs

    def outcome(ttft: float, tbt: float) -> Outcome:
        return Outcome(0.0, 100, 10, 1.0, 1.0, ttft_s=ttft, tbt_mean_s=tbt)

    f = Fidelity({}, [outcome(0.3, 0.010), outcome(0.5, 0.012)], [outcome(0.25, 0.009), outcome(0.6, 0.011)])
    path = plot_pairs(f, str(tmp_path / "pairs.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_live_decode_gaps_are_grouped_by_streams_decoding_and_prefill_waiting():
    from yuebing.metrics import Outcome
    from yuebing.replay import decode_gaps, decode_gaps_by_load

    a = Outcome(0.0, 100, 4, 1.0, 1.0, sent_at=0.0, token_times=[1.0, 1.1, 1.3, 1.4])
    b = Outcome(0.0, 100, 3, 1.0, 1.0, sent_at=1.15, token_times=[1.25, 1.35, 1.45])
    groups = decode_gaps_by_load(decode_gaps([a, b]))
    # a's 1.1-1.3 gap: a alone decoding, b waiting for its first token; a's 1.3-1.4 and
    # b's 1.35-1.45: both decoding, nobody waiting. (The 1.0-1.1 hand-off is left out.)
    assert groups.keys() == {"1/prefill", "2/idle"}
    assert groups["1/prefill"]["gaps"] == 1 and groups["1/prefill"]["mean_ms"] == pytest.approx(200)
    assert groups["2/idle"]["gaps"] == 2 and groups["2/idle"]["mean_ms"] == pytest.approx(100)


def test_decode_slowdown_beside_prefill_is_weighted_over_batch_sizes_with_enough_gaps():
    from yuebing.replay import burst_decode_slowdown

    groups = {
        "1/idle": {"gaps": 40, "mean_ms": 10.0}, "1/prefill": {"gaps": 100, "mean_ms": 12.0},  # +20 %
        "2/idle": {"gaps": 30, "mean_ms": 10.0}, "2/prefill": {"gaps": 300, "mean_ms": 14.0},  # +40 %
        "3/idle": {"gaps": 5, "mean_ms": 10.0}, "3/prefill": {"gaps": 500, "mean_ms": 30.0},  # too few idle gaps
    }
    assert burst_decode_slowdown(groups) == pytest.approx((100 * 0.2 + 300 * 0.4) / 400)
    assert burst_decode_slowdown({"1/prefill": {"gaps": 100, "mean_ms": 12.0}}) is None  # nothing to set it against


def test_joins_are_read_from_the_steps_around_them_and_the_joiners_first_gap():
    from shared.predictor import Predictor
    from yuebing.metrics import Outcome
    from yuebing.replay import decode_gaps, decode_joins, join_costs

    # a decodes in 10-ms steps; b (a whole number of blocks: no tail to compute) gets
    # its first token at 0.053 and joins in a's step that ends at 0.080, 20 ms long.
    a = Outcome(0.0, 256, 8, 1.0, 1.0, sent_at=0.0, token_times=[0.0, 0.03, 0.04, 0.05, 0.06, 0.08, 0.09, 0.10])
    b = Outcome(0.0, 256, 4, 1.0, 1.0, sent_at=0.0, token_times=[0.053, 0.08, 0.09, 0.10])
    flat = Predictor(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 0.0, 0.0))
    (join,) = decode_joins([a, b], flat, block_tokens=128)
    assert (join.first_gap, join.step, join.step_before, join.step_after) == pytest.approx((0.027, 0.02, 0.01, 0.01))
    handoff, join_step = join_costs([join] * 5)
    assert join_step == pytest.approx(0.010)  # 20 ms against the 10 ms around it
    assert handoff == pytest.approx(0.027 - 0.020 - 0.005)  # less the join step and half a step's wait
    assert join_costs([join] * 4) == (0.0, 0.0)  # too few to say
    # The join step is left out of the steps the step model is calibrated on.
    assert [g.joining for g in decode_gaps([a, b]) if g.seconds == pytest.approx(0.02)] == [True]


def test_the_calibration_burst_is_groups_arriving_at_once_with_fresh_blocks():
    import random

    from yuebing.replay import BURST_GROUP_SIZE, BURST_GROUPS, calibration_burst

    burst = calibration_burst(random.Random(0), long_prompt=2048, block_tokens=128)
    assert len(burst) == BURST_GROUPS * BURST_GROUP_SIZE
    assert len({r.timestamp_ms for r in burst}) == BURST_GROUPS
    assert all(256 <= r.input_length <= 2048 and len(r.hash_ids) * 128 >= r.input_length for r in burst)
    ids = [h for r in burst for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # random prompts: no block shared, no cache helps


def test_levelling_to_the_burst_finds_the_prefill_and_decode_speeds_that_reproduce_it():
    import random

    from shared.predictor import Predictor
    from yuebing.replay import calibration_burst, level_to_burst
    from yuebing.sim import HostSharing, SimConfig, simulate

    predictor = Predictor(prefill_coef=(9.0, 0.1, 1e-5, 1e-6), decode_coef=(4.0, 0.2, 4e-4))
    config = SimConfig(prefill=1, decode=1, policy="round_robin", block_tokens=128, kv_bytes_per_token=0, chunk_tokens=2048)
    burst = calibration_burst(random.Random(1), long_prompt=2048, block_tokens=128)
    # "Live": a cluster whose engines run 1.4× and 1.25× the profile's times.
    truth = HostSharing(prefill_scale=1.4, decode_scale=1.25, decode_slowdown_per_prefill=0.3, first_token_overhead_s=0.02)
    live = simulate(burst, replace(config, host=truth), predictor).outcomes
    found = level_to_burst(replace(truth, prefill_scale=1.0, decode_scale=1.0), burst, live, config, predictor)
    assert found.prefill_scale == pytest.approx(1.4, rel=0.03)
    assert found.decode_scale == pytest.approx(1.25, rel=0.03)
