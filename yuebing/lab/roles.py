"""Roles that follow the load in the simulator: the planner's own code
(services/conductor/planner.py) fed what the simulated Conductor sees, and its moves
carried out as the live cluster would, drain first: an instance moving leaves its old
role's placement at once and takes its new one when its old work is done (a decode
instance's requests decode to their end where they are)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.conductor.planner import Arrival, Move, Observation, Planner, PlannerParams, Role
from shared.predictor import Predictor

DRAIN_POLL_S = 1.0  # how often a draining instance is checked in simulated time


@dataclass
class RolePlan:
    """The planner's view and memory in one simulation."""

    planner: Planner
    arrivals: deque[Arrival] = field(default_factory=deque)
    slos: deque[tuple[float, float]] = field(default_factory=deque)  # (arrival, its TBT SLO)
    draining: dict[str, Role] = field(default_factory=dict)  # instance → the role it moves to
    moves: list[tuple[float, Move]] = field(default_factory=list)
    split: list[tuple[float, int]] = field(default_factory=list)  # (time, instances prefilling or draining to it)
    polling: bool = False  # a drain check is scheduled
    refusals: deque[float] = field(default_factory=deque)  # when decode room was wanting (planner.Observation)
    paces: deque[tuple[float, float, float]] = field(default_factory=deque)  # decode segments: (end, observed, predicted) s

    @classmethod
    def of(cls, predictor: Predictor, max_batch: int) -> RolePlan:
        return cls(Planner(predictor, PlannerParams(max_batch=max_batch)))

    @property
    def interval_s(self) -> float:
        return self.planner.params.interval_s

    def arrived(self, a: Arrival, slo_tbt_s: float) -> None:
        self.arrivals.append(a)
        self.slos.append((a.at, slo_tbt_s))

    def observe(self, now: float, roles: dict[str, Role], decode_batches: dict[str, int],
                prefill_queues_s: dict[str, float]) -> Observation:
        horizon = now - self.planner.params.window_s
        while self.arrivals and self.arrivals[0].at <= horizon:
            self.arrivals.popleft()
            self.slos.popleft()
        while self.refusals and self.refusals[0] <= horizon:
            self.refusals.popleft()
        while self.paces and self.paces[0][0] <= horizon:
            self.paces.popleft()
        predicted = sum(p for _, _, p in self.paces)
        slowdown = sum(o for _, o, _ in self.paces) / predicted if predicted else 1.0
        slo = sum(s for _, s in self.slos) / len(self.slos) if self.slos else 0.0
        return Observation(now, {**roles, **self.draining}, tuple(self.arrivals), slo, decode_batches, prefill_queues_s,
                           frozenset(self.draining), len(self.refusals), slowdown)

    def decide(self, obs: Observation) -> list[Move]:
        moves = self.planner.decide(obs)
        for move in moves:
            self.draining[move.instance_id] = move.to
            self.moves.append((obs.now, move))
        return moves

    def record(self, now: float, prefilling: int) -> None:
        self.split.append((now, prefilling + sum(1 for r in self.draining.values() if r == "prefill")
                           - sum(1 for r in self.draining.values() if r == "decode")))
