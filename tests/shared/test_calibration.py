"""The observed-over-predicted pace that corrects the time models."""

import math
import random

import pytest

from shared.calibration import Calibration, length_class, quantile_z


def test_without_evidence_the_pace_is_one():
    assert Calibration().pace(now=100.0) == Calibration().pace(now=0.0, z=2.0) == 1.0


def test_the_evidence_says_whether_a_pace_of_one_was_measured():
    c = Calibration(half_life_s=10.0)
    assert c.evidence_s(now=0.0) == 0.0
    c.add(0.3, 0.3, now=0.0)  # right on the prediction
    assert c.pace(now=0.0) == 1.0
    assert c.evidence_s(now=0.0) == pytest.approx(0.3) and c.evidence_s(now=10.0) == pytest.approx(0.15)


def test_the_pace_follows_the_work_observed_against_predicted():
    c = Calibration(prior_s=0.5)
    for i in range(100):  # twice as long as predicted, 0.1 s of prediction a time
        c.add(0.2, 0.1, now=i * 0.01)
    assert c.pace(now=1.0) == pytest.approx(2.0, rel=0.1)


def test_an_upper_quantile_of_the_pace_covers_that_share_of_the_work():
    rng = random.Random(1)
    c = Calibration(half_life_s=1e9)
    ratios = [math.exp(rng.gauss(0.3, 0.2)) for _ in range(2000)]
    for i, r in enumerate(ratios):
        c.add(r * 0.1, 0.1, now=i * 0.001)
    q95 = c.pace(now=2.0, z=quantile_z(0.95))
    assert sum(r <= q95 for r in ratios) / len(ratios) == pytest.approx(0.95, abs=0.02)
    assert c.pace(now=2.0) == pytest.approx(math.exp(0.3), rel=0.05)


def test_long_work_weighs_more_than_short():
    c = Calibration(half_life_s=1e9, prior_s=0.01)
    for i in range(10):
        c.add(0.05, 0.01, now=0.0)  # short prefills: fixed costs, 5x
        c.add(1.1, 1.0, now=0.0)  # long ones: 1.1x
    assert c.pace(now=0.0) < 1.3


def test_a_few_observations_do_not_outweigh_the_prior():
    c = Calibration(prior_s=0.5)
    c.add(1.0, 0.01, now=0.0)  # one request 100 times slower than predicted
    assert 1.0 < c.pace(now=0.0) < 1.2
    faster = Calibration(prior_s=0.5)
    faster.add(0.05, 0.1, now=0.0)  # ... or twice as fast: it moves the pace, a little, either way
    assert 0.7 < faster.pace(now=0.0, z=quantile_z(0.95)) < 1.0


def test_old_evidence_fades_back_to_one_and_new_evidence_takes_over():
    c = Calibration(half_life_s=5.0, prior_s=0.5)
    for i in range(50):
        c.add(0.3, 0.1, now=i * 0.1)
    assert c.pace(now=5.0) > 2.5
    assert c.pace(now=60.0) == pytest.approx(1.0, abs=0.01)  # eleven half-lives idle
    for i in range(50):
        c.add(0.05, 0.1, now=60.0 + i * 0.1)
    assert c.pace(now=65.0) < 0.7  # faster than the profile, lately


def test_nonsense_observations_are_ignored():
    c = Calibration()
    c.add(-1.0, 0.1, now=0.0)
    c.add(1.0, 0.0, now=0.0)
    assert c.pace(now=0.0) == 1.0


def test_a_stall_counts_as_ten_times_off_not_as_its_whole_length():
    stalled, clamped = Calibration(), Calibration()
    for c, observed in ((stalled, 5.0), (clamped, 0.5)):
        for _ in range(4):  # four requests caught by a 5 s stall, predicted 50 ms each
            c.add(observed, 0.05, now=0.0)
    assert stalled.pace(now=0.0, z=1.645) == clamped.pace(now=0.0, z=1.645) < 15


def test_work_far_faster_than_predicted_does_not_raise_the_upper_quantile():
    # A fifth of the prefills find their prefix cached (a tenth of the time predicted),
    # the rest take what was predicted: 95 % of the work takes at most 1x, and a
    # normal fit of the logs (mean -0.46, deviation 0.92) would have said 2.9x.
    c = Calibration(half_life_s=1e9)
    for i in range(500):
        c.add(0.01 if i % 5 == 0 else 0.1, 0.1, now=0.0)
    assert c.pace(now=0.0, z=quantile_z(0.95)) == pytest.approx(1.0, rel=0.02)
    assert c.pace(now=0.0, z=quantile_z(0.1)) == pytest.approx(0.1, rel=0.05)


def test_weights_stay_finite_over_many_half_lives():
    c = Calibration(half_life_s=10.0, prior_s=0.01)
    for t in range(5000):  # 500 half-lives
        c.add(0.2, 0.1, now=float(t))
    assert c.pace(now=5000.0) == pytest.approx(2.0, rel=0.02)
    assert all(math.isfinite(w) for w in c.bins)


def test_work_is_judged_by_work_like_it():
    # Short prefills (0.1 s) caught by bursts, one in four, run 3x; long ones (2 s)
    # average the bursts out and run 1.05x. A long prompt's tail is theirs, a short
    # one's is the bursts' (all work is at least half as long), and work longer than
    # any seen gets the median.
    c = Calibration(half_life_s=1e9)
    for i in range(200):
        c.add(0.1 * (1.0 if i % 4 else 3.0), 0.1, now=0.0)
        if i % 20 == 0:
            c.add(2.1, 2.0, now=0.0)
    tails = c.tails(0.0, z=quantile_z(0.95))
    assert tails[length_class(0.1)] > 2.5
    assert tails[length_class(4.0)] == pytest.approx(1.05, rel=0.02)
    assert tails[-1] == pytest.approx(c.pace(0.0), rel=0.01) and tails[-1] < 1.1
    assert c.pace(0.0, z=quantile_z(0.95)) > 2.5  # all work alike: the bursts' tail for everything


def test_with_little_work_like_it_a_tail_leans_to_the_median():
    c = Calibration(prior_s=0.5, half_life_s=1e9)
    for _ in range(500):
        c.add(0.011, 0.01, now=0.0)  # 5 s of short work at 1.1x
    c.add(0.3, 0.2, now=0.0)  # one longer prefill at 1.5x: 0.2 s of evidence
    tails = c.tails(0.0, z=quantile_z(0.95))
    assert 1.1 < tails[length_class(0.2)] < 1.3
    assert Calibration().tails(0.0, z=2.0) == (1.0, 1.0)  # no evidence: the profile
