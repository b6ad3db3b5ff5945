"""Request outcomes and their summary: one definition for the simulator and for the
live replay, so that their numbers can be compared.

A request's TBT is reported three ways: the plain mean gap, the 90th-percentile gap,
and, as the FAST '25 Mooncake paper measures it, the mean of its longest 10 % of
inter-token gaps (`tbt_tail`). SLO attainment uses `tbt_tail`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Outcome:
    arrival_s: float
    input_len: int
    output_len: int
    slo_ttft_s: float
    slo_tbt_s: float
    rejected: bool = False  # refused before any prefill work
    wasted_prefill: bool = False  # prefilled, then refused by decode
    failed: bool = False
    ttft_s: float | None = None
    tbt_mean_s: float = 0.0
    tbt_p90_s: float = 0.0
    tbt_tail_s: float = 0.0
    end_s: float = 0.0
    cached_tokens: int = 0
    tenant: str = ""  # whose (a simulation with tenants)
    # Live runs only (the replay's clock): when it was sent, and when each token came.
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.ttft_s is not None and not (self.rejected or self.failed or self.wasted_prefill)

    @property
    def within_slo(self) -> bool:
        return self.completed and self.ttft_s <= self.slo_ttft_s and self.tbt_tail_s <= self.slo_tbt_s


def gap_stats(gaps: Sequence[float]) -> tuple[float, float, float]:
    """(mean, p90, mean of the longest 10 %) of inter-token gaps."""
    if not gaps:
        return 0.0, 0.0, 0.0
    ordered = sorted(gaps)
    tail = ordered[-max(1, math.ceil(len(ordered) * 0.1)) :]
    return sum(ordered) / len(ordered), percentile(ordered, 90), sum(tail) / len(tail)


def segment_stats(segments: Sequence[tuple[float, int]]) -> tuple[float, float, float]:
    """`gap_stats` of gaps given as (gap, count) runs, without expanding them: the
    simulator times decode in segments of equal steps."""
    total = sum(n for _, n in segments)
    if total == 0:
        return 0.0, 0.0, 0.0
    mean = sum(g * n for g, n in segments) / total
    ordered = sorted(segments, reverse=True)
    tail_n = max(1, math.ceil(total * 0.1))
    p90_rank = total - math.ceil(0.9 * total)  # gaps longer than the p90 one
    tail_sum, seen, p90 = 0.0, 0, ordered[-1][0]
    for gap, n in ordered:
        take = min(n, tail_n - seen)
        if take > 0:
            tail_sum += gap * take
        if seen <= p90_rank < seen + n:
            p90 = gap
        seen += n
    return mean, p90, tail_sum / tail_n


def percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def _dist(values: list[float]) -> dict[str, float]:
    values.sort()
    mean = sum(values) / len(values) if values else 0.0
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def summarize(outcomes: Sequence[Outcome], duration_s: float) -> dict:
    """The documented result fields (docs/simulator.md)."""
    done = [o for o in outcomes if o.completed]
    good = sum(o.within_slo for o in done)
    prompt = sum(o.input_len for o in done)
    return {
        **_refusals(outcomes),
        "completed": len(done),
        "ttft_s": _dist([o.ttft_s for o in done]),
        "tbt_s": _dist([o.tbt_tail_s for o in done]),
        "tbt_mean_s": _dist([o.tbt_mean_s for o in done]),
        "slo_attainment": good / len(outcomes) if outcomes else 0.0,
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "cache_hit_rate": sum(o.cached_tokens for o in done) / prompt if prompt else 0.0,
        "duration_s": duration_s,
    }


def _refusals(outcomes: Sequence[Outcome]) -> dict:
    """How many requests were not served, and where they were turned away."""
    rejected = [o.input_len for o in outcomes if o.rejected]
    return {
        "requests": len(outcomes),
        "rejected": len(rejected),
        "rejected_input_mean": sum(rejected) / len(rejected) if rejected else 0.0,  # which requests admission refuses
        "wasted_prefill": sum(o.wasted_prefill for o in outcomes),
        "failed": sum(o.failed for o in outcomes),
        # Not served at all: refused at admission, after prefill, or given up on.
        "refused": sum(o.rejected or o.wasted_prefill or o.failed for o in outcomes),
    }
