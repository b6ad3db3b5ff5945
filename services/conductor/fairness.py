"""Priority and fairness among tenants when the cluster is loaded. Pure: the Conductor
asks it about a request admission would take (its SLOs met), with how loaded that
placement is and each active tenant's load; it says whether to refuse it.

Admission's SLO check stays the bound for everybody. Below it, once a placement's
predicted latency passes `loaded` of its SLO, the cluster is short of room, and what
is left goes by class and share:

- `sheddable` tenants are refused there: the rest of the room is kept for the others;
- a `standard` tenant over its weighted fair share (its weight over the weights of the
  active tenants) is refused there, so a tenant flooding cannot push another below
  its share;
- `critical` tenants are refused by the SLO check alone.

So up to `loaded` the cluster is everybody's (work-conserving: a lone tenant, or one
flooding while the others are idle, has all of it); past it, the room is kept for the
tenants below their share.

A tenant's load is counted in tokens (prompt plus max_tokens of each request: the KV
and the steps it may take), as VTC counts cost ("Fairness in Serving Large Language
Models", OSDI '24), not in requests, over what it took of late (admitted in the last
`WINDOW_S`). Past the mark, a `standard` tenant that already has a request in flight
and took more than its share of late is refused: each active tenant may always have
one request in flight, so a tenant sending one at a time is never refused for its
share, and one sending more has its second judged by what it took.

Not by the tokens each holds in flight: judged by those, a flood is let in exactly
when another tenant's request arrives (that arrival lowers the flood's share of what
is in flight), and its work lands beside the other's streams. Measured with
`yuebing bench tenants` (docs/benchmarks/tenants.md): the steady tenant's TBT then
doubled beside the flood. Judged by what it took, a flooding tenant's requests get in
as its own end, whenever the others' arrive. What it took is a rate, over the window
or over the part of it since the tenant's first admission there: judged by totals, a
tenant new to the window could take in a moment what the others took over the whole
of it (measured: a flood's first 0.7 s filled the prefill queue to the TTFT SLO, and
the steady tenant's next request was refused).

Active is admitted within the window or still streaming: the room kept for a tenant
between two of its requests must not go to a flood in the gap. The figures are the
quotas' books (services/conductor/quotas.py), so several Conductors judge alike, a
sync interval late.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from shared.config import FAIR_SHARE_MARK
from shared.tenants import Tenant

LOADED = FAIR_SHARE_MARK  # the cluster's default (ClusterConfig.fair_share_mark, where it was measured)
WINDOW_S = 10.0  # "of late": ten requests of a tenant sending one a second
MIN_SPAN_S = 1.0  # a tenant's rate is over at least this long: its first requests are not an infinite rate


@dataclass(frozen=True)
class Load:
    """One active tenant's requests in flight now, and the rate of tokens it was
    admitted of late: over the window, or over the part of it since its first
    admission there, where that is shorter (`rate`)."""

    streams: int
    recent: float  # tokens/s


def rate(tokens: int, first_at: float, now: float) -> float:
    """Tokens admitted since `first_at` (within the window), per second: a tenant new
    to the window is judged by its rate so far, not by a total it has had no time to
    take."""
    return tokens / min(WINDOW_S, max(MIN_SPAN_S, now - first_at))


@dataclass(frozen=True)
class Refused:
    cause: Literal["shed_class", "fair_share"]
    reason: str


def judge(tenant: Tenant, pressure: float, loads: Mapping[str, Load], weights: Mapping[str, float],
          loaded: float = LOADED) -> Refused | None:
    """None: admit. `pressure`: the placement's predicted TTFT (or TBT) over its SLO,
    the larger; `loads`: each active tenant's; `weights`: theirs."""
    if tenant.priority == "critical" or pressure <= loaded:
        return None
    if tenant.priority == "sheddable":
        return Refused("shed_class", f"cluster past {loaded:.0%} of its SLOs: sheddable requests wait")
    if not any(t != tenant.id for t in loads):
        return None  # nobody else active to keep room for: all of it is this tenant's
    recent = share_of(tenant, {t: x.recent for t, x in loads.items()}, weights)
    if tenant.id in loads and loads[tenant.id].streams > 0 and recent > 1.0:
        return Refused("fair_share", f"cluster past {loaded:.0%} of its SLOs and this tenant, a request already in "
                                     f"flight, is taking {recent:.1f}x its fair share of the tokens admitted of late")
    return None


def share_of(tenant: Tenant, tokens: Mapping[str, int], weights: Mapping[str, float]) -> float:
    """`tenant`'s tokens over its weighted share of them all, among the active tenants
    (and itself): 1.0 is its share exactly; 0 where nobody holds any."""
    total_weight = sum(weights.get(t, 1.0) for t in tokens if t != tenant.id) + tenant.weight
    share = sum(tokens.values()) * tenant.weight / total_weight
    return tokens.get(tenant.id, 0) / share if share else 0.0
