"""Roles that follow the load in the simulator: the live Conductor's own `Roles`
(services/conductor/roles.py: the planner's window and its moves) fed what the
simulated Conductor sees, and the moves carried out as the live cluster would, drain
first: an instance moving leaves its old role's placement at once and takes its new
one when its old work is done (a decode instance's requests decode to their end
where they are). Outputs are known here, so decode is priced by each request's."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.conductor.planner import Arrival, Planner, PlannerParams
from services.conductor.roles import Roles
from shared.predictor import Predictor


@dataclass
class RolePlan:
    """What the simulation adds to the Conductor's `Roles`: each arrival's TBT SLO
    (they may differ), decode steps observed over predicted (the live cluster's
    calibration), and the split over time."""

    roles: Roles
    slos: deque[tuple[float, float]] = field(default_factory=deque)  # (arrival, its TBT SLO)
    paces: deque[tuple[float, float, float]] = field(default_factory=deque)  # decode segments: (end, observed, predicted) s
    split: list[tuple[float, int]] = field(default_factory=list)  # (time, instances prefilling or draining to it)
    polling: bool = False  # a drain check is scheduled

    @classmethod
    def of(cls, predictor: Predictor, params: PlannerParams) -> RolePlan:
        return cls(Roles(Planner(predictor, params), since=0.0))  # the simulated clock starts at 0, with the trace

    @property
    def params(self) -> PlannerParams:
        assert self.roles.planner is not None
        return self.roles.planner.params

    @property
    def draining(self) -> dict[str, str]:
        return self.roles.draining  # type: ignore[return-value]

    def arrived(self, a: Arrival, slo_tbt_s: float) -> None:
        self.roles.arrived(a)
        self.slos.append((a.at, slo_tbt_s))

    def decide(self, now: float, roles: dict, decode_batches: dict[str, int], prefill_queues_s: dict[str, float]) -> bool:
        """The planner's turn; True when it started a move."""
        horizon = now - self.params.window_s
        while self.slos and self.slos[0][0] <= horizon:
            self.slos.popleft()
        while self.paces and self.paces[0][0] <= horizon:
            self.paces.popleft()
        predicted = sum(p for _, _, p in self.paces)
        slowdown = sum(o for _, o, _ in self.paces) / predicted if predicted else 1.0
        slo = sum(s for _, s in self.slos) / len(self.slos) if self.slos else 0.0
        return bool(self.roles.decide(now, roles, slo, decode_batches, prefill_queues_s, slowdown))

    def record(self, now: float, prefilling: int) -> None:
        moving = list(self.draining.values())
        self.split.append((now, prefilling + moving.count("prefill") - moving.count("decode")))
