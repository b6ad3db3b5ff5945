"""The planner: how many instances of a fixed fleet prefill and how many decode, from
what the Conductor sees. An observation and its clock in, a role change (or none)
out, no I/O: the simulator runs the same code (yuebing/lab/sim.py).

Demand comes from the last `window_s` of arrivals (or the part of it since the
Conductor started), priced by the time models
admission uses (shared/predictor.py):

  prefill  seconds of prefill work arriving per second: the arrival rate times the
           predicted prefill of the mean uncached prompt (times the prefill instances'
           observed pace, where they are slower than predicted), over
           `prefill_utilization` (an instance kept fully busy queues without bound);
  decode   requests decoding at once (Little's law: the arrival rate times each
           one's decode time, its output at that batch's step) over the batch an
           instance may hold (the largest whose predicted step keeps `tbt_headroom`
           of the TBT SLO), planned `decode_utilization` full.

The fleet is split in proportion to the two (at least one instance of each), decode
never given fewer than it needs (prefill's shortfall is shed by admission before
any work is done; decode's breaks the TBT of a whole batch). In adaptive mode, where
decode instances prefill what no prefill instance takes, the fleet may instead be
pooled (no prefill instance: every engine prefills and decodes), where prefill needs
less than half an instance or pooled instances have more room than the split. A
pooled instance prefills only in the room its own decode steps leave: a step that
carries a prompt chunk is held to the TBT SLO, so the more it decodes, the less
prompt each step takes (the interference disaggregation avoids; Demand.headroom).
And it takes only the prompts admission would spill onto it: those whose fullest
step there keeps the TBT SLO (Demand.pooled_share; on a host slower than its
profile, a capped chunk beside a batch may not, and every long prompt is refused).

While decode refuses requests for want of room (more than `refusal_share` of the
window's arrivals: admission's TBT rejections, decodes refusing what prefill
computed, whose prefill is then wasted), the split moves toward decode whatever
the time models say: the cost of too few decode instances is work already done.
Instances are moved toward that split only when it serves `min_gain` more of the
demand than the split as it is (the share of requests a split serves: its busier role's
capacity over that role's demand, prefill's counted in requests, cheapest prompt
first, since admission sheds the costliest; on a plateau of splits that all serve it,
nothing moves; between pooled and split, `min_gain` more room), and only when:
  - the target has disagreed with the split `confirm` decisions in a row (no flapping
    on a burst),
  - each has kept its role `dwell_s` and is not still draining from a move,
  - and at most `move_share_per_min` of the fleet moves in any minute.

What it moves: the decode instance decoding the fewest requests, or the prefill
instance with the shortest queue; both drain first: the Conductor sends it nothing
of its old role, and it takes its new one once its old work is done (a decode
instance's streams finish where they are; nothing is migrated).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Literal

from services.conductor.modes import ColocatedLoad, fullest_step_s
from services.conductor.policy import Request
from shared.config import PLANNER_CONFIRM, PLANNER_DWELL_S, PLANNER_INTERVAL_S, PLANNER_WINDOW_S, ClusterConfig
from shared.predictor import Predictor, prefill_marginal_s

Role = Literal["prefill", "decode"]
MINUTE_S = 60.0


@dataclass(frozen=True)
class PlannerParams:
    # How fast it follows a shift (shared/config.py says why these defaults).
    window_s: float = PLANNER_WINDOW_S  # the arrivals demand is judged on
    interval_s: float = PLANNER_INTERVAL_S  # between decisions
    confirm: int = PLANNER_CONFIRM  # decisions in a row that must want the same move
    dwell_s: float = PLANNER_DWELL_S  # an instance keeps a role at least this long
    move_share_per_min: float = 0.5  # of the fleet, moved in any minute at most (at least one instance)
    prefill_utilization: float = 0.8  # the share of a prefill instance's time planned busy
    decode_utilization: float = 0.7  # the share of a decode instance's batch planned full (bursts need room)
    decode_burst_z: float = 2.0  # decode room planned for bursts, in standard deviations of the requests decoding
    tbt_headroom: float = 0.9  # the share of the TBT SLO a decode batch is sized to
    max_batch: int = 128  # requests a decode instance holds at most (vLLM's max_num_seqs)
    refusal_share: float = 0.01  # decode refusals beyond this share of arrivals move an instance to decode
    min_gain: float = 0.05  # a move must raise the share of demand the split can serve by this much
    # Adaptive mode: decode instances prefill what no prefill instance takes (modes.py),
    # so the prefill role may be left empty when it needs less than half an instance.
    empty_prefill: bool = False
    # ... and how they prefill, as the cluster runs its engines: an engine step's token
    # budget (ClusterConfig.step_tokens) and a decode engine's cap on one prompt's
    # chunk (ClusterConfig.prompt_chunk_tokens; 0: none). A pooled instance takes
    # only the prompts whose fullest step keeps the TBT SLO of those decoding there.
    step_tokens: int = 2048
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.interval_s <= 0 or self.dwell_s < 0 or self.confirm < 1:
            raise ValueError("planner: window and interval must be positive, confirm at least 1")
        if not 0 < self.move_share_per_min <= 1 or self.decode_burst_z < 0:
            raise ValueError("planner: move_share_per_min must be in (0, 1], decode_burst_z at least 0")
        if not all(0 < x <= 1 for x in (self.prefill_utilization, self.decode_utilization, self.tbt_headroom)):
            raise ValueError("planner: prefill_utilization, decode_utilization and tbt_headroom must be in (0, 1]")



def planner_timing(config: ClusterConfig) -> dict[str, float | int]:
    """PlannerParams' timing fields from a ClusterConfig (`--planner-window-s`, ...)."""
    return {"window_s": config.planner_window_s, "interval_s": config.planner_interval_s,
            "confirm": config.planner_confirm, "dwell_s": config.planner_dwell_s}

@dataclass(frozen=True)
class Arrival:
    """One request as demand: when it came, the prompt tokens it needed computed
    (after what was cached), its prompt and its output length."""

    at: float
    uncached_tokens: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Observation:
    now: float
    roles: dict[str, Role]  # every instance's role, a draining one's new role already
    arrivals: tuple[Arrival, ...]  # the window's (older ones are ignored)
    slo_tbt_s: float
    decode_batches: dict[str, int] = field(default_factory=dict)  # requests decoding on each decode instance
    prefill_queues_s: dict[str, float] = field(default_factory=dict)  # each prefill instance's work ahead
    moving: frozenset[str] = frozenset()  # instances still draining from a move: not moved again
    # The window's requests refused for want of decode room: admission's TBT
    # rejections, and decodes that refused a prefilled request (its prefill wasted).
    decode_refusals: int = 0
    # Decode steps as observed over as predicted (the Conductor's calibration): what
    # the time models miss, e.g. the prompt tails joining requests add to a step.
    decode_slowdown: float = 1.0
    # How long a request decodes, where outputs are not known at arrival (the live
    # Conductor's learned t_d); None: each arrival's output at the sized batch's step.
    decode_time_s: float | None = None
    # First tokens as observed over as predicted, on the prefill instances: a host
    # slower than the profile's needs more prefill instances for the same arrivals.
    prefill_slowdown: float = 1.0
    # When arrivals began to be counted (the Conductor's start): a window reaching
    # back before it saw only part of its span, and its rate is over that part.
    since: float = -math.inf


@dataclass(frozen=True)
class Demand:
    prefill: float  # instances needed, fractional
    decode: float
    target_prefill: int  # the split it asks for (the rest decode; none: pooled)
    forced: bool = False  # decode is refusing: the move is due whatever it gains
    # The share of a pooled instance's time its own decode steps leave to prefill
    # chunks: a step carrying a chunk is held to the TBT SLO, so the busier its batch,
    # the less prompt each step can take (the interference a split avoids).
    pooled_free: float = 1.0
    # The window's requests cheapest prompt first, each with the share of the window's
    # prefill work it and the cheaper ones need (rising to 1; empty: all alike).
    prefill_shares: tuple[float, ...] = ()
    # The share of the window's requests a pooled instance would take at all: adaptive
    # admission spills a prompt onto a decoding engine only where its fullest step keeps
    # the TBT SLO there (modes.better_both); the rest are refused, whatever the room.
    pooled_share: float = 1.0

    def headroom(self, prefills: int, decodes: int) -> float:
        """How many times over a split can serve the demand, its busier role the bound.
        With no prefill instance the fleet is pooled: every instance's time serves both
        roles, its prefill only in the room its decode steps leave (`pooled_free`)."""
        if not prefills:
            times = min(_times(decodes, self.prefill + self.decode), _times(decodes * self.pooled_free, self.prefill))
            return min(times, self.pooled_share) if self.pooled_share < 1 else times
        return min(self._prefill_times(prefills), _times(decodes, self.decode))

    def _prefill_times(self, instances: int) -> float:
        """Prefill's bound, in requests: short of the need, admission sheds the
        costliest prompts first (a long one misses its TTFT first), so the instances
        serve every request whose prompt fits cheapest first, more requests than their
        share of the work. On `yuebing sim-planner --mode adaptive`'s steady trace,
        past capacity, one prefill instance has under half the work's time and 1P
        serves the most requests; counted in work, the planner pooled the fleet."""
        times = _times(instances, self.prefill)
        if times >= 1 or not self.prefill_shares:
            return times
        return bisect.bisect_right(self.prefill_shares, times) / len(self.prefill_shares)

    def served(self, prefills: int, decodes: int) -> float:
        """The share of the demand a split can serve."""
        return min(1.0, self.headroom(prefills, decodes))

    def detail(self) -> str:
        return f"needs {self.prefill:.2f} prefill and {self.decode:.2f} decode instances: {self.target_prefill} prefill"

    def summary(self) -> str:
        """`detail` with what decides between pooled and split (the planner's log line)."""
        return (f"{self.detail()}; forced {self.forced}, pooled share {self.pooled_share:.2f}, "
                f"pooled free {self.pooled_free:.2f}")


def _times(capacity: float, need: float) -> float:
    return capacity / need if need > 0 else math.inf


@dataclass(frozen=True)
class Move:
    instance_id: str
    to: Role
    reason: str  # the demand that asked for it, for the log and the counter's detail


def demand(obs: Observation, predictor: Predictor, params: PlannerParams) -> Demand | None:
    """What the window's arrivals ask of each role (None: no arrivals to judge by)."""
    recent = [a for a in obs.arrivals if a.at > obs.now - params.window_s]
    if not recent:
        return None
    rate = len(recent) / _span(obs, params)
    uncached = sum(a.uncached_tokens for a in recent) / len(recent)
    prompt = sum(a.prompt_tokens for a in recent) / len(recent)
    output = sum(a.output_tokens for a in recent) / len(recent)
    prefill_s = predictor.prefill_s(round(uncached), round(prompt - uncached)) * max(1.0, obs.prefill_slowdown)
    prefill = rate * prefill_s / params.prefill_utilization
    ctx = prompt + output / 2  # a decoding request's mean context over its output
    slow = max(1.0, obs.decode_slowdown)
    step_cap_s = obs.slo_tbt_s * params.tbt_headroom
    batch = sized_batch(predictor, ctx, step_cap_s / slow, params.max_batch)
    each_s = obs.decode_time_s if obs.decode_time_s is not None else \
        max(0.0, output - 1) * predictor.decode_step_s(batch, round(batch * ctx)) * slow
    concurrent = rate * each_s  # Little's law
    # Square-root staffing: arrivals are bursty, and the fewer decode at once, the
    # larger a burst is beside them (Poisson: its spread is the mean's square root).
    decode = (concurrent + params.decode_burst_z * math.sqrt(concurrent)) / (batch * params.decode_utilization)
    # Pooled, each instance decodes its share of the requests in steps held to the cap.
    each = math.ceil(concurrent / len(obs.roles))
    free = max(0.0, 1 - predictor.decode_step_s(each, round(each * ctx)) * slow / step_cap_s) if each else 1.0
    forced = obs.decode_refusals > params.refusal_share * len(recent)
    taken = _pooled_share(recent, predictor, params, each, ctx, slow, obs.slo_tbt_s)
    return _split(Demand(prefill, decode, 0, forced, free, _prefill_shares(recent, predictor), taken), obs, params)


def _pooled_share(recent: list[Arrival], predictor: Predictor, params: PlannerParams, each: int, ctx: float,
                  slow: float, slo_tbt_s: float) -> float:
    """`Demand.pooled_share`: the window's requests whose prefill, on a pooled instance
    decoding `each` requests with nothing queued (the state most in its favour), puts
    no step past the TBT SLO there, priced by admission's own rule. On a host slower
    than its profile a capped chunk beside a batch can break the SLO: the pooled fleet
    then refuses long prompts however much room the time models give it."""
    if not params.empty_prefill:
        return 1.0
    load = ColocatedLoad("pooled", 0, 0, each, round(each * ctx), slowdown=slow, decode_chunk_tokens=params.chunk_tokens,
                         pooled=True)
    fits = sum(fullest_step_s(load, _as_request(a, slo_tbt_s), predictor, 1, params.step_tokens) <= slo_tbt_s
               for a in recent)
    return fits / len(recent)


def _as_request(a: Arrival, slo_tbt_s: float) -> Request:
    """An arrival as admission sees it, its cached tokens left out of its prompt."""
    return Request("", max(1, a.uncached_tokens), 0, a.output_tokens, math.inf, slo_tbt_s)


def _prefill_shares(recent: list[Arrival], predictor: Predictor) -> tuple[float, ...]:
    """`Demand.prefill_shares`: each prompt's work beyond a step's fixed cost (shared
    by the prompts batched in a step), cumulated cheapest first, over the total."""
    costs = sorted(prefill_marginal_s(predictor, [(a.uncached_tokens, a.prompt_tokens - a.uncached_tokens)])
                   for a in recent)
    total = sum(costs)
    return tuple(c / total for c in accumulate(costs)) if total > 0 else ()


def _span(obs: Observation, params: PlannerParams) -> float:
    """The seconds of the window arrivals were counted in: all of it, but for a
    Conductor that started within it (at least one interval: a rate over the first
    seconds is mostly noise)."""
    return max(params.interval_s, min(params.window_s, obs.now - obs.since))


def _split(d: Demand, obs: Observation, params: PlannerParams) -> Demand:
    """The split `d` asks for: in proportion to the two roles' needs, decode never
    short; in adaptive mode pooled (no prefill instance) where that has more room."""
    n = len(obs.roles)
    share = d.prefill / (d.prefill + d.decode) if d.prefill + d.decode > 0 else 0.5
    # Decode gets at least what it needs: prefill's shortfall is shed by admission
    # before any work, decode's breaks the TBT of a whole batch or wastes a prefill.
    # (unless decode alone needs the whole fleet: then the proportional split).
    room = n - math.ceil(d.decode)
    target = min(round(n * share), room) if room >= 1 else round(n * share)
    if d.forced:
        # Decode is refusing what prefill computed: a prefill instance more would only
        # waste more. Whatever the time models say, the split moves toward decode, but
        # not to no prefill instance where the demand wants prefill: decode instances
        # would then prefill it all themselves, more work for the role that is refusing
        # (measured live: 38 good requests against 97 kept at 1P+1D, past capacity).
        target = min(target, max(1, sum(1 for r in obs.roles.values() if r == "prefill") - 1))
    split = min(n - 1, max(1, target))
    if not params.empty_prefill:
        return replace(d, target_prefill=split)
    # Adaptive mode may pool the fleet: where prefill needs under half an instance (and
    # pooled engines would take every prompt, or serve more than the split), or (decode
    # not refusing: its steps then have the room the models say) where pooled
    # instances serve the demand with more room than the split.
    roomier = d.headroom(0, n) >= d.headroom(split, n - split)
    pooled = (roomier and (target == 0 or not d.forced)) or (target == 0 and d.pooled_share >= 1)
    return replace(d, target_prefill=0 if pooled else split)


def sized_batch(predictor: Predictor, ctx_tokens: float, step_s: float, most: int) -> int:
    """The largest batch (at least 1) whose decode step, each request holding
    `ctx_tokens`, takes at most `step_s`."""
    lo, hi = 1, most
    if predictor.decode_step_s(hi, round(hi * ctx_tokens)) <= step_s:
        return hi
    while hi - lo > 1:  # the step grows with the batch: bisect for the last that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predictor.decode_step_s(mid, round(mid * ctx_tokens)) <= step_s else (lo, mid)
    return lo


@dataclass
class Planner:
    """The decisions' memory: the streak behind a wanted move, when each instance
    last changed role, and the last minute's moves."""

    predictor: Predictor
    params: PlannerParams = PlannerParams()
    streak: int = 0
    wanted: Role | None = None
    judged: Demand | None = None  # the last turn's demand, for the log line that explains a move or its absence
    changed_at: dict[str, float] = field(default_factory=dict)
    moves: deque[float] = field(default_factory=deque)

    def decide(self, obs: Observation) -> list[Move]:
        """The moves to start now (none, mostly): toward the target split, as many as
        the last minute's budget leaves, once the target has held `confirm` times."""
        d = self.judged = demand(obs, self.predictor, self.params)
        prefills = sum(1 for r in obs.roles.values() if r == "prefill")
        want = self._wanted(d, prefills, len(obs.roles))
        self.streak = self.streak + 1 if want is not None and want == self.wanted else int(want is not None)
        self.wanted = want
        if want is None or d is None or self.streak < self.params.confirm:
            return []
        count = min(abs(d.target_prefill - prefills), self._budget(obs.now, len(obs.roles)), self._spare(obs))
        moves = [Move(iid, want, d.detail()) for iid in self._candidates(obs, want)[:count]]
        for m in moves:
            self.changed_at[m.instance_id] = obs.now
            self.moves.append(obs.now)
        self.streak = 0 if moves else self.streak
        return moves

    def _wanted(self, d: Demand | None, prefills: int, n: int) -> Role | None:
        """The role the demand wants one more instance of (None: the split is right,
        or moving would not serve `min_gain` more of the demand)."""
        if d is None or d.target_prefill == prefills:
            return None
        to, now = (d.target_prefill, n - d.target_prefill), (prefills, n - prefills)
        if not d.forced and not self._gains(d, to, now):
            return None
        return "prefill" if d.target_prefill > prefills else "decode"

    def _gains(self, d: Demand, to: tuple[int, int], now: tuple[int, int]) -> bool:
        """Whether the split `to` serves `min_gain` more of the demand than `now`. Between
        pooled and split, by room (`min_gain` more of it), not by share served: on a
        plateau where both serve the load, pooled instances still start prompts on
        every engine, with no transfer, and a split keeps decode from prefill's chunks."""
        if 0 in (to[0], now[0]):
            return d.headroom(*to) > d.headroom(*now) * (1 + self.params.min_gain)
        return d.served(*to) - d.served(*now) > self.params.min_gain

    @staticmethod
    def _spare(obs: Observation) -> int:
        """Moves that leave an instance serving: a moving one drains, serving nothing new,
        so the last one is never moved. The fleet is the live instances: where the
        others missed their heartbeats under load, a lone survivor moved away had left
        the cluster with no engine to place on (503s, measured live on 2 instances)."""
        return max(0, sum(1 for iid in obs.roles if iid not in obs.moving) - 1)

    def _budget(self, now: float, fleet: int) -> int:
        """Moves the last minute leaves room for."""
        while self.moves and self.moves[0] <= now - MINUTE_S:
            self.moves.popleft()
        most = max(1, math.floor(self.params.move_share_per_min * fleet))
        return max(0, most - len(self.moves))

    def _candidates(self, obs: Observation, to: Role) -> list[str]:
        """The instances that may move, cheapest first (see the module's text): of the
        other role, not mid-move, kept their role `dwell_s`."""
        source: Role = "decode" if to == "prefill" else "prefill"
        ready = [iid for iid, role in obs.roles.items() if role == source and iid not in obs.moving
                 and obs.now - self.changed_at.get(iid, -float("inf")) >= self.params.dwell_s]
        cost = obs.decode_batches if source == "decode" else obs.prefill_queues_s
        return sorted(ready, key=lambda iid: (cost.get(iid, 0), iid))
