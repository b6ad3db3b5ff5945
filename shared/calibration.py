"""How much slower (or faster) an instance runs than its time model says, and how
much that varies: what its recent work took against what the model predicted.

The time models (shared/predictor.py) are fitted on an engine alone on its
machine. Live, an engine shares its cores (with other engines, the gateway, the
Conductor, the clients) and under load its work takes longer than the profile
says; admission that trusts the profile alone then admits more than the
instances can serve within the SLOs, and does so exactly when it matters, under
overload. And under overload admission holds every queue at the edge of its SLO,
so a prediction right on average still has half the requests admitted at that
edge miss it. So the Conductor multiplies a prediction by a quantile of the
observed-over-predicted ratio (`pace(z)`: the mean of its log and z standard
deviations more), not by its mean (docs/benchmarks/chaos-and-soak.md: the soak at 3x).

Observations are weighted by their predicted seconds: a long prefill says more
about the pace than a short one, whose time is mostly fixed costs. Plain data
with an explicit clock: the decode service feeds it its requests' token gaps, the
Conductor its prefills' first tokens, the simulator its own clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

HALF_LIFE_S = 10.0  # evidence this old counts half: the pace follows a change of load in seconds
# Predicted seconds of evidence, at a ratio of exactly 1, that observations must
# outweigh: a few requests prove nothing, and with no recent work the pace returns to 1.
PRIOR_S = 0.5
# One piece of work ten times off its prediction is a fault (a stalled process, a
# retry), not a pace: liveness and retries deal with faults, and a few such requests
# must not shut an instance out for minutes. It counts as ten times off.
MAX_RATIO = 10.0


def quantile_z(share: float) -> float:
    """The z whose `pace` work stays within about `share` of the time."""
    return NormalDist().inv_cdf(share)


@dataclass
class Calibration:
    half_life_s: float = HALF_LIFE_S
    prior_s: float = PRIOR_S
    weight: float = 0.0  # decayed sums over observations of x = log(observed / predicted), weighted by predicted s
    sum_x: float = 0.0
    sum_xx: float = 0.0
    at: float = 0.0  # when the sums were last decayed

    def add(self, observed_s: float, predicted_s: float, now: float) -> None:
        """Work that took `observed_s` and was predicted to take `predicted_s`."""
        if observed_s <= 0 or predicted_s <= 0:
            return
        self._decay(now)
        x = math.log(min(max(observed_s / predicted_s, 1 / MAX_RATIO), MAX_RATIO))
        self.weight += predicted_s
        self.sum_x += predicted_s * x
        self.sum_xx += predicted_s * x * x

    def pace(self, now: float, z: float = 0.0) -> float:
        """Observed over predicted time: its typical value (z = 0), or the one that
        work exceeds about as often as a normal variable exceeds z."""
        self._decay(now)
        total = self.weight + self.prior_s
        mean = self.sum_x / total
        variance = self.sum_xx / total - mean * mean
        return math.exp(mean + z * math.sqrt(max(variance, 0.0)))

    def _decay(self, now: float) -> None:
        if now > self.at:
            kept = 0.5 ** ((now - self.at) / self.half_life_s)
            self.weight *= kept
            self.sum_x *= kept
            self.sum_xx *= kept
            self.at = now
