"""What the decode service measures of its own pace: a request's token gaps
against the steps the time model predicted for them."""

import pytest

from services.decode.handler import Pace


def test_a_requests_pace_is_its_token_gaps_against_its_predicted_steps():
    pace = Pace()
    pace.step(1, 0.010, first=True, now=5.0)  # prompt's rest and KV load: not a decode step
    pace.step(1, 0.010, first=False, now=5.02)
    pace.step(3, 0.012, first=False, now=5.08)  # three tokens at once: three steps
    assert pace.observed_s == pytest.approx(0.08)
    assert pace.predicted_s == pytest.approx(0.010 + 3 * 0.012)
