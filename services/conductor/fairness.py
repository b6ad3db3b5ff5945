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
Models", OSDI '24), not in requests. It is over its share when it is over on both
counts, what it holds now (its requests' tokens in flight) and what it took of late
(admitted in the last `WINDOW_S`). Either alone would refuse a tenant sending one
request a second: by what it holds, whenever two of its requests overlap while the
flood, held to its share, has one; by what it took, whenever chance bunches its
requests, the flood held to the same rate. A tenant new to the window is over on
both counts once it took as much as the others did in it: the window is short so
that this first burst is small.

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


@dataclass(frozen=True)
class Load:
    """One active tenant's tokens: in flight now, and admitted within the window."""

    holding: int
    recent: int


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
    holding = share_of(tenant, {t: x.holding for t, x in loads.items()}, weights)
    recent = share_of(tenant, {t: x.recent for t, x in loads.items()}, weights)
    if holding > 1.0 and recent > 1.0:
        return Refused("fair_share", f"cluster past {loaded:.0%} of its SLOs and this tenant is over its fair share "
                                     f"({holding:.1f}x of it in the tokens in flight, {recent:.1f}x in those of "
                                     f"the last {WINDOW_S:g} s)")
    return None


def share_of(tenant: Tenant, tokens: Mapping[str, int], weights: Mapping[str, float]) -> float:
    """`tenant`'s tokens over its weighted share of them all, among the active tenants
    (and itself): 1.0 is its share exactly; 0 where nobody holds any."""
    total_weight = sum(weights.get(t, 1.0) for t in tokens if t != tenant.id) + tenant.weight
    share = sum(tokens.values()) * tenant.weight / total_weight
    return tokens.get(tenant.id, 0) / share if share else 0.0
