"""Scheduling policies: plain data in, a decision out, no I/O.

The live Conductor and the simulator call the very same functions. Only the
baseline lives here for now; the KVCache-centric policies build on this interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.messages import Heartbeat


@dataclass(frozen=True)
class Decision:
    prefill_id: str
    decode_id: str


@dataclass(frozen=True)
class Rejection:
    kind: Literal["overloaded", "unavailable"]
    reason: str
    retry_after_s: float


class RoundRobin:
    """Each role in turn, over the instances alive at the moment of the request."""

    def __init__(self) -> None:
        self._turn = {"prefill": 0, "decode": 0}

    def choose(self, prefills: list[Heartbeat], decodes: list[Heartbeat]) -> Decision | Rejection:
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            return Rejection("unavailable", f"no live {missing} instance", retry_after_s=1.0)
        return Decision(prefill_id=self._next("prefill", prefills), decode_id=self._next("decode", decodes))

    def _next(self, role: str, live: list[Heartbeat]) -> str:
        chosen = live[self._turn[role] % len(live)]
        self._turn[role] += 1
        return chosen.instance_id


POLICIES = {"round_robin": RoundRobin}


def make_policy(name: str) -> RoundRobin:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
