"""Priority and fairness among tenants when the cluster is loaded. Pure: the Conductor
asks it about a request admission would take (its SLOs met), with how loaded that
placement is and each tenant's requests in flight; it says whether to refuse it.

Admission's SLO check stays the bound for everybody. Below it, once a placement's
predicted latency passes `loaded` of its SLO, the cluster is short of room, and what
is left goes by class and share:

- `sheddable` tenants are refused there: the rest of the room is kept for the others;
- a `standard` tenant holding its weighted fair share of the requests in flight (its
  weight over the weights of the tenants with requests in flight) is refused there,
  so a tenant flooding cannot push another below its share;
- `critical` tenants are refused by the SLO check alone.

So up to `loaded` the cluster is everybody's (work-conserving: a lone tenant, or one
flooding while the others are idle, has all of it); past it, the room is kept for the
tenants below their share.

Requests in flight are counted as the quotas count streams (services/conductor/quotas.py),
so several Conductors judge shares by the same figures, a sync interval late.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from shared.config import FAIR_SHARE_MARK
from shared.tenants import Tenant

LOADED = FAIR_SHARE_MARK  # the cluster's default (ClusterConfig.fair_share_mark, where it was measured)


@dataclass(frozen=True)
class Refused:
    cause: Literal["shed_class", "fair_share"]
    reason: str


def judge(tenant: Tenant, pressure: float, in_flight: Mapping[str, int], weights: Mapping[str, float],
          loaded: float = LOADED) -> Refused | None:
    """None: admit. `pressure`: the placement's predicted TTFT (or TBT) over its SLO,
    the larger; `in_flight`: each tenant's requests now; `weights`: theirs."""
    if tenant.priority == "critical" or pressure <= loaded:
        return None
    if tenant.priority == "sheddable":
        return Refused("shed_class", f"cluster past {loaded:.0%} of its SLOs: sheddable requests wait")
    if not any(n > 0 for t, n in in_flight.items() if t != tenant.id):
        return None  # nobody else's requests to keep room for: all of it is this tenant's
    share = fair_share(tenant, in_flight, weights)
    if in_flight.get(tenant.id, 0) >= share:
        return Refused("fair_share", f"cluster past {loaded:.0%} of its SLOs and this tenant holds its fair share "
                                     f"({share:.1f} of {sum(in_flight.values())} requests in flight)")
    return None


def fair_share(tenant: Tenant, in_flight: Mapping[str, int], weights: Mapping[str, float]) -> float:
    """`tenant`'s weighted share of the requests in flight, among the tenants with some
    (and itself); at least one request, so a tenant alone is never refused for share."""
    active = {t for t, n in in_flight.items() if n > 0} | {tenant.id}
    total_weight = sum(weights.get(t, 1.0) for t in active if t != tenant.id) + tenant.weight
    return max(1.0, sum(in_flight.values()) * tenant.weight / total_weight)
