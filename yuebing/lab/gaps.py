"""Live runs' decode gaps, read the way the simulator's step model can be checked and
calibrated against: each gap with the load around it (requests decoding, a prefill
waiting), the steps in which a request joined decode, and what those cost.

The live replay sees only token arrival times at the client; the readings here rest
on two facts of the serving path: tokens of one decode step reach the client within
`SAME_STEP_S` of each other, and with one prefill instance a request waiting for its
first token means a prefill running (or queued).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from yuebing.lab.outcome import Outcome


@dataclass(frozen=True)
class DecodeGap:
    """One gap between two decode tokens of a live request, and the load around it."""

    seconds: float
    batch: int  # requests decoding at its middle
    context: int  # their tokens then (prompts and what they had generated)
    beside_prefill: bool  # a request was waiting for its first token meanwhile
    joining: bool = False  # another request joined decode in this step (its first decode token ends it)


# Tokens of one decode step reach the client within this of each other.
SAME_STEP_S = 0.002


def decode_gaps(outcomes: Sequence[Outcome]) -> list[DecodeGap]:
    """A live run's decode gaps: each request's after its hand-off to decode. With one
    prefill instance, a request waiting for its first token means a prefill running
    (or queued)."""
    decoding = [o for o in outcomes if len(o.token_times) > 2]
    waiting = [(o.sent_at, o.token_times[0]) for o in outcomes if o.token_times]
    gaps = []
    for o in decoding:
        for a, b in itertools.pairwise(o.token_times[1:]):
            mid = (a + b) / 2
            batch = [x for x in decoding if x.token_times[1] <= mid <= x.token_times[-1]]
            context = sum(x.input_len + bisect.bisect(x.token_times, mid) for x in batch)
            busy = any(s < b and a < e for s, e in waiting)
            joining = any(x is not o and abs(x.token_times[1] - b) < SAME_STEP_S for x in decoding)
            gaps.append(DecodeGap(b - a, len(batch), context, busy, joining))
    return gaps


@dataclass(frozen=True)
class DecodeJoin:
    """A live request joining decode while others decode, seen from both sides."""

    first_gap: float  # its first token to its second (its first from decode)
    step: float  # the others' step that ends with its second token: the step it joined in
    step_before: float  # their step before that one, and after it
    step_after: float


def decode_joins(outcomes: Sequence[Outcome]) -> list[DecodeJoin]:
    """Every request of a live run that joined decode beside requests already decoding."""
    decoding = [o for o in outcomes if len(o.token_times) > 2]
    joins = []
    for j in decoding:
        second = j.token_times[1]
        seen = [(t[k] - t[k - 1], t[k - 1] - t[k - 2], t[k + 1] - t[k])
                for t in (o.token_times for o in decoding if o is not j)
                for k in range(3, len(t) - 1) if abs(t[k] - second) < SAME_STEP_S]
        if seen:
            step, before, after = (statistics.fmean(x) for x in zip(*seen))
            joins.append(DecodeJoin(second - j.token_times[0], step, before, after))
    return joins


def join_costs(joins: Sequence[DecodeJoin], min_joins: int = 5) -> tuple[float, float]:
    """(handoff_s, join_step_s) for HostSharing from `decode_joins`: how much longer
    the step a request joins in is than the steps around it (loading its KV,
    computing its first token); and what its first gap holds besides that step and the wait for the step
    in progress when it came (half that step, on average). (0, 0) with too few joins."""
    if len(joins) < min_joins:
        return 0.0, 0.0
    join_step = statistics.fmean(j.step - (j.step_before + j.step_after) / 2 for j in joins)
    handoff = statistics.fmean(j.first_gap - j.step - j.step_before / 2 for j in joins)
    return max(0.0, handoff), max(0.0, join_step)


def decode_gaps_by_load(gaps: Sequence[DecodeGap], max_batch: int = 6) -> dict[str, dict[str, float]]:
    """`decode_gaps` grouped by how many requests were decoding ("3/...", capped at
    `max_batch`) and whether a prefill ran beside ("/prefill", else "/idle"): what the
    simulator's step model can be checked against, condition by condition."""
    groups: dict[str, list[float]] = {}
    for g in gaps:
        if g.joining:  # a step another request joined in: join_costs models those
            continue
        key = f"{min(max_batch, g.batch)}/{'prefill' if g.beside_prefill else 'idle'}"
        groups.setdefault(key, []).append(g.seconds)
    return {k: {"gaps": len(v), "mean_ms": statistics.fmean(v) * 1e3} for k, v in sorted(groups.items())}


def burst_decode_slowdown(groups: dict[str, dict[str, float]], min_gaps: int = 20) -> float | None:
    """How much slower decode steps are while a prefill runs, from `decode_gaps_by_load`
    groups: per batch size, beside a prefill against idle, weighted by the gaps beside
    a prefill; None when no batch size has `min_gaps` of both."""
    pairs = []
    for key, busy in groups.items():
        batch, kind = key.split("/")
        idle = groups.get(f"{batch}/idle")
        if kind == "prefill" and idle and min(busy["gaps"], idle["gaps"]) >= min_gaps:
            pairs.append((busy["gaps"], busy["mean_ms"] / idle["mean_ms"] - 1))
    return sum(w * r for w, r in pairs) / sum(w for w, _ in pairs) if pairs else None


def decode_slowdown_in_windows(decoded: list[list[float]], windows: list[tuple[float, float]]) -> float:
    """How much slower decode steps are while a prefill runs, from the token times of
    decode streams and the windows in which prefills ran: their gaps inside a window
    against their gaps well outside one."""
    inside, outside = [], []
    for times in decoded:
        for a, b in itertools.pairwise(times):
            if any(s <= a and b <= e for s, e in windows):
                inside.append(b - a)
            elif not any(a < e + 0.1 and s < b for s, e in windows):  # nor the step where the probe joins decode
                outside.append(b - a)
    return statistics.mean(inside) / statistics.mean(outside) - 1 if inside and outside else 0.0
