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
observed-over-predicted ratio (`pace(z)`), not by its mean (docs/benchmarks/chaos-and-soak.md:
the soak at 3x). The quantile is read off the observations themselves, not off a
normal fit of their logs: their spread is lopsided (a prefix the books did not
know was cached makes one prefill far faster than predicted, nothing makes one far
slower but a fault), and a fitted spread counts those fast ones as risk: it put
the 95th percentile of a conversation trace's prefills well above where 95 % of them
ended, refusing prompts that would have been served in time.

Work is judged by work like it (`tail`): a prediction's upper quantile is read off
the observations at least half as long, with the median of all work to fall back
on. A burst of interference (a neighbour's step, a collector pause) makes a short
prompt far slower than its prediction and a long one hardly at all: measured live
on a real model (docs/benchmarks/goodput.md), after a 0.8 s prefill ran 1.4x, the
95th percentile of all work refused a 2,000-token prompt predicted at 5.6 s that
took 4.1 s. Under overload the predictions that matter are long queues, judged by
the queues before them, as they were.

Observations are weighted by their predicted seconds: a long prefill says more
about the pace than a short one, whose time is mostly fixed costs. Plain data
with an explicit clock: the decode service feeds it its requests' token gaps, the
Conductor its prefills' first tokens, the simulator its own clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

HALF_LIFE_S = 10.0  # evidence this old counts half: the pace follows a change of load in seconds
# Predicted seconds of evidence, at a ratio of exactly 1, that observations must
# outweigh: a few requests prove nothing, and with no recent work the pace returns to 1.
PRIOR_S = 0.5
# One piece of work ten times off its prediction is a fault (a stalled process, a
# retry), not a pace: liveness and retries deal with faults, and a few such requests
# must not shut an instance out for minutes. It counts as ten times off.
MAX_RATIO = 10.0
# The log ratios' histogram: bins of 1.8 % of a ratio each, one centred on exactly 1.
BINS = 257
_LOG_MAX = math.log(MAX_RATIO)
_WIDTH = 2 * _LOG_MAX / BINS
# Lengths of work, by predicted seconds: class k from 1 ms x 2**k, the last open-ended.
CLASSES = 20
_SHORTEST_S = 1e-3
# Weights are kept scaled up by 2 ** (age in half-lives) rather than all decayed at
# every observation; past this many half-lives they are scaled back (2 ** 1024 overflows).
_REBASE_HALF_LIVES = 64.0


def quantile_z(share: float) -> float:
    """The z whose `pace` work stays within about `share` of the time."""
    return NormalDist().inv_cdf(share)


def length_class(predicted_s: float) -> int:
    """Which doubling of predicted seconds work falls in."""
    if predicted_s <= _SHORTEST_S:
        return 0
    return min(CLASSES - 1, int(math.log2(predicted_s / _SHORTEST_S)))


def _bin(x: float) -> int:
    return min(BINS - 1, max(0, int((x + _LOG_MAX) / _WIDTH)))


def _centre(index: int) -> float:
    return -_LOG_MAX + (index + 0.5) * _WIDTH


@dataclass
class Calibration:
    half_life_s: float = HALF_LIFE_S
    prior_s: float = PRIOR_S
    # Observations of x = log(observed / predicted), weighted by predicted seconds and
    # by 2 ** ((when - origin) / half_life_s): histograms whose newer weight counts more.
    # at_least[k]: of the work in length class k or longer (at_least[0]: all of it).
    at_least: list[list[float]] = field(default_factory=lambda: [[0.0] * BINS for _ in range(CLASSES)])
    origin: float = 0.0
    longest: int = -1  # the longest class observed
    # (share, class) → (log ratio at that quantile, scaled weight): kept until the next
    # observation, as decay scales every weight alike and moves no quantile.
    _quantiles: dict[tuple[float, int], tuple[float, float]] = field(default_factory=dict, init=False, repr=False)

    @property
    def bins(self) -> list[float]:
        """Every observation's weight by log ratio."""
        return self.at_least[0]

    def add(self, observed_s: float, predicted_s: float, now: float) -> None:
        """Work that took `observed_s` and was predicted to take `predicted_s`."""
        if observed_s <= 0 or predicted_s <= 0:
            return
        x = math.log(min(max(observed_s / predicted_s, 1 / MAX_RATIO), MAX_RATIO))
        index, weight, k = _bin(x), predicted_s * self._scale(now), length_class(predicted_s)
        for bins in self.at_least[: k + 1]:
            bins[index] += weight
        self.longest = max(self.longest, k)
        self._quantiles.clear()

    def pace(self, now: float, z: float = 0.0) -> float:
        """Observed over predicted time: its median (z = 0), or the one that work
        exceeds about as often as a normal variable exceeds z (z = 1.645: 5 %). The
        observations' quantile, its log shrunk toward 1 by the prior's weight: with
        little evidence the pace stays near 1, whichever side the evidence is on."""
        x, weight = self._quantile(NormalDist().cdf(z), 0)
        evidence = weight / self._scale(now)
        return math.exp(x * evidence / (evidence + self.prior_s)) if evidence > 0 else 1.0

    def evidence_s(self, now: float) -> float:
        """Predicted seconds of the work the pace rests on, as they count now (decayed;
        0: none, and the pace is 1). A pace of exactly 1 is also what work within a bin
        of the prediction gives: this says which."""
        return sum(self.bins) / self._scale(now)

    def tails(self, now: float, z: float) -> tuple[float, ...]:
        """For work of each length class, from the shortest: the pace it exceeds about
        as often as a normal variable exceeds z. The quantile of the work at least half
        as long, shrunk by its weight toward the median pace of all work; the last
        entry, the median alone, is for work longer than any observed."""
        median = math.log(self.pace(now))
        share, scale = NormalDist().cdf(z), self._scale(now)
        paces = []
        for k in range(self.longest + 2):
            x, weight = self._quantile(share, max(0, k - 1))
            evidence = weight / scale
            paces.append(math.exp(median + (x - median) * evidence / (evidence + self.prior_s)))
        return (*paces, math.exp(median))

    def _quantile(self, share: float, k: int) -> tuple[float, float]:
        """Class k and longer: the log ratio below which `share` of their weight lies,
        and that weight (scaled, as the bins are: a quantile needs no unscaling)."""
        cached = self._quantiles.get((share, k))
        if cached is None:
            bins = self.at_least[k]
            total = sum(bins)
            cached = self._quantiles[(share, k)] = (_centre(_first_reaching(bins, share * total)), total)
        return cached

    def _scale(self, now: float) -> float:
        """What a weight added now is multiplied by (its share decays from here)."""
        age = (now - self.origin) / self.half_life_s
        if age > _REBASE_HALF_LIVES:
            self.at_least = [[w * 2.0 ** -age for w in bins] for bins in self.at_least]
            self._quantiles.clear()
            self.origin, age = now, 0.0
        return 2.0 ** age


def _first_reaching(weights: list[float], target: float) -> int:
    total = 0.0
    for index, weight in enumerate(weights):
        total += weight
        if total >= target and weight > 0:
            return index
    return BINS - 1
