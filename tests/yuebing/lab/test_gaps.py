"""A live run's decode gaps, read against the simulator's step model."""

import pytest

from yuebing.lab.gaps import (
    burst_decode_slowdown,
    decode_gaps,
    decode_gaps_by_load,
    decode_joins,
    decode_slowdown_in_windows,
    join_costs,
)
from yuebing.lab.outcome import Outcome


def test_live_decode_gaps_are_grouped_by_streams_decoding_and_prefill_waiting():
    a = Outcome(0.0, 100, 4, 1.0, 1.0, sent_at=0.0, token_times=[1.0, 1.1, 1.3, 1.4])
    b = Outcome(0.0, 100, 3, 1.0, 1.0, sent_at=1.15, token_times=[1.25, 1.35, 1.45])
    groups = decode_gaps_by_load(decode_gaps([a, b]))
    # a's 1.1-1.3 gap: a alone decoding, b waiting for its first token; a's 1.3-1.4 and
    # b's 1.35-1.45: both decoding, nobody waiting. (The 1.0-1.1 hand-off is left out.)
    assert groups.keys() == {"1/prefill", "2/idle"}
    assert groups["1/prefill"]["gaps"] == 1 and groups["1/prefill"]["mean_ms"] == pytest.approx(200)
    assert groups["2/idle"]["gaps"] == 2 and groups["2/idle"]["mean_ms"] == pytest.approx(100)


def test_decode_slowdown_beside_prefill_is_weighted_over_batch_sizes_with_enough_gaps():
    groups = {
        "1/idle": {"gaps": 40, "mean_ms": 10.0}, "1/prefill": {"gaps": 100, "mean_ms": 12.0},  # +20 %
        "2/idle": {"gaps": 30, "mean_ms": 10.0}, "2/prefill": {"gaps": 300, "mean_ms": 14.0},  # +40 %
        "3/idle": {"gaps": 5, "mean_ms": 10.0}, "3/prefill": {"gaps": 500, "mean_ms": 30.0},  # too few idle gaps
    }
    assert burst_decode_slowdown(groups) == pytest.approx((100 * 0.2 + 300 * 0.4) / 400)
    assert burst_decode_slowdown({"1/prefill": {"gaps": 100, "mean_ms": 12.0}}) is None  # nothing to set it against


def test_decode_slowdown_in_windows_sets_gaps_inside_a_prefill_against_gaps_well_outside():
    stream = [0.0, 0.01, 0.02, 0.03, 0.045, 0.06, 0.075, 0.5, 0.51, 0.52]
    # Inside the 0.03-0.08 prefill: 15-ms gaps; the 0.075-0.5 gap overlaps it (left
    # out); 0.5-0.52 is well after it; 0.0-0.03 before it.
    assert decode_slowdown_in_windows([stream], [(0.03, 0.08)]) == pytest.approx(0.5)
    assert decode_slowdown_in_windows([stream], []) == 0.0


def test_joins_are_read_from_the_steps_around_them_and_the_joiners_first_gap():
    # a decodes in 10-ms steps; b gets
    # its first token at 0.053 and joins in a's step that ends at 0.080, 20 ms long.
    a = Outcome(0.0, 256, 8, 1.0, 1.0, sent_at=0.0, token_times=[0.0, 0.03, 0.04, 0.05, 0.06, 0.08, 0.09, 0.10])
    b = Outcome(0.0, 256, 4, 1.0, 1.0, sent_at=0.0, token_times=[0.053, 0.08, 0.09, 0.10])
    (join,) = decode_joins([a, b])
    assert (join.first_gap, join.step, join.step_before, join.step_after) == pytest.approx((0.027, 0.02, 0.01, 0.01))
    handoff, join_step = join_costs([join] * 5)
    assert join_step == pytest.approx(0.010)  # 20 ms against the 10 ms around it
    assert handoff == pytest.approx(0.027 - 0.020 - 0.005)  # less the join step and half a step's wait
    assert join_costs([join] * 4) == (0.0, 0.0)  # too few to say
    # The join step is left out of the steps the step model is calibrated on.
    assert [g.joining for g in decode_gaps([a, b]) if g.seconds == pytest.approx(0.02)] == [True]
