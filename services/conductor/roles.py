"""Each engine instance's role as the Conductor uses it, and the planner's view.

Every engine service takes both prefill and decode orders on its one engine (its KV
connector serves both), so a role is the Conductor's choice, not the process's: an
instance serves its launch role until the planner (services/conductor/planner.py)
moves it. A move drains first: the instance gets nothing of its old role at once,
and takes its new one when the books hold none of its old work (a decode
instance's streams decode to their end where they are; nothing is migrated). An
instance that restarts comes back in its launch role.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from services.conductor.planner import Arrival, Move, Observation, Planner, Role
from services.conductor.state import ClusterState
from shared.messages import Heartbeat

log = structlog.get_logger(__name__)
# How often a draining instance is checked for its new role between the planner's
# turns: a prefill instance drains in about a TTFT, and waiting a whole turn would
# leave it idle in neither role meanwhile. (The simulator checks as often.)
DRAIN_POLL_S = 1.0
ENGINE_ROLES = ("prefill", "decode")


@dataclass
class Roles:
    planner: Planner | None = None  # None: roles stay as launched (nothing moves them)
    assigned: dict[str, Role] = field(default_factory=dict)  # moved instances' roles
    draining: dict[str, Role] = field(default_factory=dict)  # instance → the role it moves to
    arrivals: deque[Arrival] = field(default_factory=deque)  # the planner's window
    refusals: deque[float] = field(default_factory=deque)  # when decode room was wanting
    changes: int = 0
    since: float | None = None  # when it began counting arrivals (Observation.since; None: not yet)

    def of(self, hb: Heartbeat) -> Role | None:
        """The role an engine instance serves new requests in (None: draining: neither)."""
        if hb.instance_id in self.draining or hb.role not in ENGINE_ROLES:
            return None
        return self.assigned.get(hb.instance_id, hb.role)  # type: ignore[return-value]

    def emptied(self, role: Role, engines: Iterable[Heartbeat]) -> bool:
        """Whether `role` has no instance because the planner moved its live ones away
        (not because they died)."""
        return any(hb.role == role and self.of(hb) != role for hb in engines)

    def forget(self, instance_id: str) -> None:
        """It restarted, or left: back to its launch role if it returns."""
        self.assigned.pop(instance_id, None)
        self.draining.pop(instance_id, None)

    # --- the planner's inputs ------------------------------------------------
    def watching(self, now: float) -> None:
        """The Conductor hears the cluster from `now` (its first heartbeat): the
        planner's window holds no arrival from before."""
        if self.since is None:
            self.since = now

    def arrived(self, a: Arrival) -> None:
        if self.planner is not None:
            self.arrivals.append(a)

    def refused_for_decode(self, now: float) -> None:
        if self.planner is not None:
            self.refusals.append(now)

    # --- moves ---------------------------------------------------------------
    def settle(self, state: ClusterState) -> None:
        """Draining instances whose old work is done take their new role."""
        for iid, to in list(self.draining.items()):
            busy = state.decode.get(iid) if to == "prefill" else (iid in state.prefill and state.prefill[iid].outstanding)
            if busy:
                continue
            del self.draining[iid]
            self.assigned[iid] = to
            state.add_instance(to, iid)
            log.info("role changed", instance_id=iid, role=to)

    def plan(self, now: float, engines: Iterable[Heartbeat], state: ClusterState, slo_tbt_s: float,
             slowdown: float) -> list[Move]:
        """The live Conductor's turn: finished drains settle, then the planner may
        start moves on the books (outputs unknown at arrival: decode priced by t_d)."""
        self.settle(state)
        # A CPP group (several stages) prefills as one pipeline: it keeps its role.
        roles: dict[str, Role] = {hb.instance_id: self.assigned.get(hb.instance_id, hb.role)  # type: ignore[misc]
                                  for hb in engines if hb.role in ENGINE_ROLES and hb.stages <= 1}
        batches = {iid: len(state.decode.get(iid, {})) for iid, r in roles.items() if r == "decode"}
        queues = {x.instance_id: x.queue_s for x in state.prefill_loads([], now) if roles.get(x.instance_id) == "prefill"}
        return self.decide(now, roles, slo_tbt_s, batches, queues, slowdown, state.decode_time_s,
                           state.prefill_pace(now, queues))

    def decide(self, now: float, roles: dict[str, Role], slo_tbt_s: float, decode_batches: dict[str, int],
               prefill_queues_s: dict[str, float], slowdown: float = 1.0,
               decode_time_s: float | None = None, prefill_slowdown: float = 1.0) -> list[Move]:
        """The planner on the window's demand and these instances (their roles before
        any move in progress; the simulator calls this too). Moves start draining."""
        if self.planner is None:
            return []
        horizon = now - self.planner.params.window_s
        while self.arrivals and self.arrivals[0].at <= horizon:
            self.arrivals.popleft()
        while self.refusals and self.refusals[0] <= horizon:
            self.refusals.popleft()
        obs = Observation(now, {**roles, **self.draining}, tuple(self.arrivals), slo_tbt_s, decode_batches,
                          prefill_queues_s, frozenset(self.draining), len(self.refusals), slowdown, decode_time_s,
                          prefill_slowdown, self.since if self.since is not None else now)
        moves = self.planner.decide(obs)
        for m in moves:
            self.draining[m.instance_id] = m.to
            self.changes += 1
            log.info("role change", instance_id=m.instance_id, to=m.to, reason=m.reason)
        return moves
