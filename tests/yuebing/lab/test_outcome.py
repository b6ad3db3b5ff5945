"""Outcomes and their summary: what the simulator and the live replay both report."""

import pytest

from yuebing.lab.outcome import Outcome, gap_stats, segment_stats, summarize


def test_segment_stats_equal_gap_stats_of_the_expanded_gaps():
    segments = [(0.5, 1), (0.01, 40), (0.03, 7), (0.02, 12)]
    expanded = [g for g, n in segments for _ in range(n)]
    assert segment_stats(segments) == pytest.approx(gap_stats(expanded))


def test_tbt_tail_is_the_mean_of_the_longest_tenth_of_gaps():
    mean, p90, tail = gap_stats([0.01] * 18 + [0.05, 0.07])
    assert mean == pytest.approx(0.015) and p90 == pytest.approx(0.01) and tail == pytest.approx(0.06)


def test_the_summary_counts_refusals_and_attainment_over_every_request():
    def served(ttft: float, tail: float, cached: int = 0) -> Outcome:
        return Outcome(0.0, 100, 10, 1.0, 0.05, ttft_s=ttft, tbt_tail_s=tail, cached_tokens=cached)

    outcomes = [served(0.5, 0.01, 50), served(2.0, 0.01), served(0.5, 0.09, 50),
                Outcome(0.0, 300, 10, 1.0, 0.05, rejected=True), Outcome(0.0, 100, 10, 1.0, 0.05, failed=True),
                Outcome(0.0, 100, 10, 1.0, 0.05, ttft_s=0.3, wasted_prefill=True)]
    result = summarize(outcomes, duration_s=2.0)
    assert (result["requests"], result["completed"], result["refused"]) == (6, 3, 3)
    assert (result["rejected"], result["failed"], result["wasted_prefill"]) == (1, 1, 1)
    assert result["rejected_input_mean"] == 300
    assert result["slo_attainment"] == pytest.approx(1 / 6) and result["goodput_rps"] == pytest.approx(0.5)
    assert result["cache_hit_rate"] == pytest.approx(100 / 300)  # of the completed requests' prompts
    assert result["ttft_s"]["mean"] == pytest.approx(1.0)
