"""Scheduling and admission policies: plain data in, a decision out, no I/O.

The live Conductor and the simulator call the very same `Scheduler.schedule`; they
differ only in where the loads come from (heartbeats and bookkeeping vs. a clock).

Prefill policies, by name:
  random, round_robin, least_loaded   baselines
  overlap_load   Dynamo's KV router: cost = w·blocks to prefill + blocks active
  cache_aware    min over instances of queue + prefill(uncached tokens)
  kvcentric      Mooncake's Algorithm 1: cache_aware + cache load balancing (pulls)
  preble         Preble's E2: exploit long matches, explore by load otherwise
A CPP pipeline group (services/conductor/cpp.py) takes a prompt from whatever the
policy chose among single instances when it would finish it sooner (`route_long`).
Admission, by name: none, early_reject, predictive (Mooncake §7).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar, get_args

from services.conductor.cpp import PipelineGroup, pipeline_prefill_s
from shared.calibration import length_class
from shared.config import SHORTLIST
from shared.predictor import Predictor


# --- inputs -------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_len: int
    prompt_blocks: int  # full blocks of the prompt (the hashed ones)
    max_tokens: int
    slo_ttft_s: float
    slo_tbt_s: float
    # Instances that just failed this request (a retry, services/gateway/retry.py):
    # never placed there again, whatever their load says.
    avoid: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """One prefill instance as the policy sees it, for one request."""

    instance_id: str
    queue_s: float  # predicted wait before it could start this request
    active_blocks: int  # prompt blocks assigned to it and not yet prefilled
    prefix_blocks: int  # leading blocks of this request it holds
    hit_ratio: float = 0.0  # recent share of prompt tokens it served from cache
    window_load_s: float = 0.0  # prefill seconds assigned to it over the recent window
    free_blocks: int = 1 << 30  # cache room before it must evict
    slowdown: float = 1.0  # its times observed over predicted (shared/calibration.py)
    # The same for work of each length class (shared.calibration.length_class), from the
    # shortest, the last for any longer; empty: `slowdown` for all.
    paces: tuple[float, ...] = ()
    group: PipelineGroup | None = None  # a CPP pipeline group (services/conductor/cpp.py); None: one instance


@dataclass(frozen=True, slots=True)
class DecodeItem:
    """A request on a decode instance: decoding from `start` until `end` (predicted)."""

    start: float
    end: float
    ctx_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    instance_id: str
    items: tuple[DecodeItem, ...]  # running now, or joining when their prefill ends
    capacity: int = 1 << 30  # requests its KV cache can hold at once
    slowdown: float = 1.0  # its steps observed over predicted (shared/calibration.py)
    decode_chunk_tokens: int = 0  # its engine's cap on one prompt's tokens per step (0: none)

    def at(self, t: float) -> tuple[int, int]:
        """(batch, context tokens) of what will be decoding at time t."""
        batch = tokens = 0
        for i in self.items:
            if i.start <= t < i.end:
                batch += 1
                tokens += i.ctx_tokens
        return batch, tokens

    def peak(self, t0: float, t1: float) -> tuple[int, int]:
        """The largest (batch, context tokens) at any moment of [t0, t1): the load only
        grows when a request joins, so the moments to look at are t0 and every start."""
        moments = [t0, *(i.start for i in self.items if t0 < i.start < t1)]
        return max((self.at(t) for t in moments), default=(0, 0))


# --- outputs ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefillChoice:
    instance_id: str
    ttft_s: float  # predicted: queue + transfer + prefill
    cached_blocks: int  # blocks it will not compute (held, or pulled)
    pull_from: str = ""  # kvcentric: the holder to copy the missing blocks from
    pull_blocks: int = 0


@dataclass(frozen=True)
class Route:
    """Why a prefill went to a CPP group or a single instance, when both were live:
    counted by the Conductor like its other decisions."""

    kind: Literal["cpp", "single"]
    reason: str  # faster (cpp); short_input, group_slower_now (single)
    detail: str  # the predicted TTFTs compared

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.reason}"


@dataclass(frozen=True)
class Decision:
    prefill: PrefillChoice
    decode_id: str
    tbt_s: float  # predicted TBT on the decode instance once this request joins
    route: Route | None = None  # None: no CPP group was live


@dataclass(frozen=True)
class DecodeDecision:
    """A decode instance alone, for a request already prefilled (a retry)."""

    decode_id: str
    tbt_s: float


# fair_share and shed_class: among tenants once loaded (services/conductor/fairness.py).
Cause = Literal["ttft_slo", "tbt_slo", "no_room", "no_instance", "fair_share", "shed_class"]
CAUSES: tuple[str, ...] = get_args(Cause)


@dataclass(frozen=True)
class Rejection:
    kind: Literal["overloaded", "unavailable"]
    reason: str
    retry_after_s: float
    decode: bool = False  # for want of decode room (its TBT SLO, or a full batch): the planner's signal
    # What refused it, as /metrics counts it: ttft_slo, tbt_slo, no_room (a full
    # decode batch) or no_instance (none live or none left to try).
    cause: Cause = "no_instance"


@dataclass(frozen=True)
class Params:
    block_size: int
    overlap_weight: float = 1.0  # overlap_load: w
    overlap_temperature: float = 0.0  # overlap_load: 0 picks the minimum, >0 samples
    balance_threshold: float = 2.0  # kvcentric: best_prefix / local_prefix that triggers a pull
    preble_hit_ratio: float = 0.7  # preble: a cache-heavy instance takes explored requests
    preble_imbalance: float = 1.5  # preble: heaviest/lightest load that triggers rebalancing
    decode_time_s: float = 10.0  # predictive admission: t_d, the uniform decode duration
    # t_d from the decodes that complete (a running mean; decode_time_s its start):
    # a configured guess can be far off the workload's (seconds against minutes).
    learn_decode_time: bool = False
    # Instances scored per role beyond those holding the prompt's longest prefixes
    # (state.py `prefill_loads`): the least loaded few; 0 scores every instance, and
    # so does a role of fewer than twice as many. A decision then costs the same on
    # 1,000 instances as on 16 (docs/benchmarks/simulator.md, "Fleet scale":
    # placement within 0.2 % of scoring every instance).
    shortlist: int = SHORTLIST


@dataclass
class Context:
    """What a policy may consult besides the loads: time models, knobs, randomness
    and round-robin position (the only state a policy keeps)."""

    predictor: Predictor
    params: Params
    rng: random.Random
    turn: int = 0


PrefillPolicy = Callable[[Request, Sequence[PrefillLoad], Context], PrefillChoice]


# --- prefill policies ---------------------------------------------------------
def prefill_s(predictor: Predictor, group: PipelineGroup | None, new_tokens: int, cached_tokens: int) -> float:
    """A prompt's prefill on one instance, or chunk by chunk through a CPP group's stages."""
    if group is None:
        return predictor.prefill_s(new_tokens, cached_tokens)
    return pipeline_prefill_s(predictor, group, new_tokens, cached_tokens)


def _ttft(load: PrefillLoad, cached_blocks: int, req: Request, ctx: Context, transfer_s: float = 0.0) -> float:
    """Queue, then prefill of what is not cached (at least the last token is computed),
    at the pace the instance keeps now."""
    cached = min(cached_blocks * ctx.params.block_size, req.prompt_len - 1)
    if load.group is None:  # `prefill_s` written out: this is the scheduler's hot path
        work = ctx.predictor.prefill_s(req.prompt_len - cached, cached)
    else:
        work = pipeline_prefill_s(ctx.predictor, load.group, req.prompt_len - cached, cached)
    profiled = load.queue_s + transfer_s + work
    return pace_of(load, profiled) * profiled


def pace_of(load: PrefillLoad, predicted_s: float) -> float:
    """The instance's pace for work this long: a burst of interference makes a short
    prompt far slower than its profile and a long one hardly at all."""
    if not load.paces:
        return load.slowdown
    return load.paces[min(length_class(predicted_s), len(load.paces) - 1)]


def _plain(load: PrefillLoad, req: Request, ctx: Context) -> PrefillChoice:
    """The choice of an instance using only what it holds itself."""
    return PrefillChoice(load.instance_id, _ttft(load, load.prefix_blocks, req, ctx), load.prefix_blocks)


def random_policy(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    return _plain(ctx.rng.choice(loads), req, ctx)


def round_robin(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    load = loads[ctx.turn % len(loads)]
    ctx.turn += 1
    return _plain(load, req, ctx)


def least_loaded(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    return _plain(min(loads, key=lambda x: (x.queue_s, x.active_blocks)), req, ctx)


def overlap_load(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    w = ctx.params.overlap_weight
    costs = [w * (req.prompt_blocks - x.prefix_blocks) + x.active_blocks for x in loads]
    t = ctx.params.overlap_temperature
    if t <= 0:
        best = min(range(len(loads)), key=costs.__getitem__)
    else:  # softmax over negative normalised cost, as Dynamo samples
        scale = max(costs) - min(costs) or 1.0
        weights = [math.exp(-(c - min(costs)) / scale / t) for c in costs]
        best = ctx.rng.choices(range(len(loads)), weights=weights)[0]
    return _plain(loads[best], req, ctx)


def cache_aware(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    return _plain(min(loads, key=lambda x: _ttft(x, x.prefix_blocks, req, ctx)), req, ctx)


def kvcentric(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    """Mooncake's Algorithm 1: an instance whose own prefix is much shorter than the
    best one may count the best one as cached if copying it beats recomputing it."""
    holder = max(loads, key=lambda x: x.prefix_blocks)
    best = (math.inf, holder, False)  # (ttft, instance, pulls)
    for load in loads:
        ttft, pull = _ttft(load, load.prefix_blocks, req, ctx), False
        missing = holder.prefix_blocks - load.prefix_blocks
        if missing > 0 and holder.prefix_blocks > ctx.params.balance_threshold * load.prefix_blocks:
            transfer = ctx.predictor.transfer_s(missing * ctx.params.block_size)
            with_pull = _ttft(load, holder.prefix_blocks, req, ctx, transfer)
            if with_pull < ttft:  # transfer beats recompute
                ttft, pull = with_pull, True
        if ttft < best[0]:
            best = (ttft, load, pull)
    ttft, chosen, pull = best
    if not pull:
        return PrefillChoice(chosen.instance_id, ttft, chosen.prefix_blocks)
    missing = holder.prefix_blocks - chosen.prefix_blocks
    return PrefillChoice(chosen.instance_id, ttft, holder.prefix_blocks, holder.instance_id, missing)


def preble(req: Request, loads: Sequence[PrefillLoad], ctx: Context) -> PrefillChoice:
    """Preble's E2 scheduling (exploit/explore), then load rebalancing."""
    bs, p = ctx.params.block_size, ctx.params
    longest = max(x.prefix_blocks for x in loads)
    matched = min(longest * bs, req.prompt_len)
    if matched > req.prompt_len - matched:  # exploit: the match is worth more than the rest
        chosen = min((x for x in loads if x.prefix_blocks == longest), key=lambda x: x.window_load_s)
    else:
        heavy_hitters = [x for x in loads if x.hit_ratio >= p.preble_hit_ratio]
        if heavy_hitters:  # decode-heavy instances have prefill to spare
            chosen = min(heavy_hitters, key=lambda x: x.window_load_s)
        else:
            chosen = min(loads, key=lambda x: _preble_cost(x, req, ctx))
    lightest = min(loads, key=lambda x: x.window_load_s)
    if chosen.window_load_s >= p.preble_imbalance * lightest.window_load_s and chosen is not lightest:
        chosen = lightest
    return _plain(chosen, req, ctx)


def _preble_cost(load: PrefillLoad, req: Request, ctx: Context) -> float:
    """Load over the window + cost of what this request would evict + its own prefill."""
    bs = ctx.params.block_size
    cached = min(load.prefix_blocks * bs, req.prompt_len - 1)
    new_blocks = req.prompt_blocks - load.prefix_blocks
    evicted = max(0, new_blocks - load.free_blocks)
    # An evicted block costs its recomputation, as often as the instance's blocks get reused.
    eviction = load.hit_ratio * ctx.predictor.prefill_s(evicted * bs, 0)
    return load.window_load_s + eviction + prefill_s(ctx.predictor, load.group, req.prompt_len - cached, cached)


def route_long(req: Request, choice: PrefillChoice, groups: Sequence[PrefillLoad], ctx: Context
               ) -> tuple[PrefillChoice, Route]:
    """CPP (Mooncake §5.1): the policy chose among single instances; the best CPP
    group takes the prompt instead when its predicted TTFT is lower (long uncached
    inputs, whose chunks overlap across its stages). A short prompt stays: a group
    pays a stage hand-over and every stage's step cost for no overlap."""
    ttft, _, group = min((_ttft(x, x.prefix_blocks, req, ctx), x.instance_id, x) for x in groups)
    detail = f"{group.instance_id} {ttft * 1e3:.0f} ms, {choice.instance_id} {choice.ttft_s * 1e3:.0f} ms"
    if ttft < choice.ttft_s:
        return PrefillChoice(group.instance_id, ttft, group.prefix_blocks), Route("cpp", "faster", detail)
    idle = replace(group, queue_s=0.0, slowdown=1.0, paces=())
    busy = _ttft(idle, group.prefix_blocks, req, ctx) < choice.ttft_s  # its queue or measured pace lost it
    return choice, Route("single", "group_slower_now" if busy else "short_input", detail)


PREFILL_POLICIES: dict[str, PrefillPolicy] = {
    "random": random_policy,
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "overlap_load": overlap_load,
    "cache_aware": cache_aware,
    "kvcentric": kvcentric,
    "preble": preble,
}
ADMISSIONS = ("none", "early_reject", "predictive")
# The policies that score instances, which a shortlist serves as well as the whole
# fleet; random and round_robin score nothing, and a shortlist would change them.
SHORTLISTED = frozenset({"least_loaded", "overlap_load", "cache_aware", "kvcentric", "preble"})


# --- decode choice and admission ----------------------------------------------
def decode_context(prompt_len: int, max_tokens: int) -> int:
    """The context a decoding request is counted with: its prompt and half its
    output (its mean context over the decode, the output's length unknown)."""
    return prompt_len + max_tokens // 2


def joining_tbt_s(predictor: Predictor, batch: int, tokens: int, prompt_len: int) -> float:
    """The decode step once a request of `prompt_len` prompt tokens joins a batch of
    `batch` requests attending to `tokens` tokens: the TBT admission judges, and
    decode's double check on arrival (services/decode/handler.py) too."""
    return predictor.decode_step_s(batch + 1, tokens + prompt_len)


def tbt_exceeded(tbt_s: float, slo_tbt_s: float, where: str) -> str:
    return f"predicted TBT {tbt_s * 1e3:.1f} ms on {where} exceeds the SLO of {slo_tbt_s * 1e3:.1f} ms"


def tbt_at(load: DecodeLoad, t: float, req: Request, ctx: Context, until: float | None = None) -> float:
    """Predicted TBT on `load` at time t (or at its busiest until `until`), with this
    request in the batch; infinite when its KV cache would have no room for it."""
    batch, tokens = load.at(t) if until is None else load.peak(t, until)
    if batch + 1 > load.capacity:
        return math.inf
    return load.slowdown * joining_tbt_s(ctx.predictor, batch, tokens, req.prompt_len)


def choose_decode(
    req: Request, loads: Sequence[DecodeLoad], t: float, ctx: Context, until: float | None = None
) -> tuple[DecodeLoad, float]:
    """The decode instance with the lowest predicted TBT at time t (or over [t, until))."""
    tbts = [(tbt_at(x, t, req, ctx, until), x.instance_id, x) for x in loads]
    tbt, _, load = min(tbts, key=lambda x: (x[0], x[1]))
    return load, tbt


class Scheduler:
    """A prefill policy and an admission mode, by name."""

    def __init__(self, policy: str, admission: str, predictor: Predictor, params: Params, seed: int = 0) -> None:
        if policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(PREFILL_POLICIES)}")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {admission!r}; choose from {', '.join(ADMISSIONS)}")
        self.policy = PREFILL_POLICIES[policy]
        self.admission = admission
        # How many least loaded instances per role the books hand this policy (0: all).
        self.shortlist = params.shortlist if policy in SHORTLISTED else 0
        self.ctx = Context(predictor, params, random.Random(seed))

    def schedule(
        self, req: Request, prefills: Sequence[PrefillLoad], decodes: Sequence[DecodeLoad], now: float,
        decode_time_s: float | None = None,
    ) -> Decision | Rejection:
        """`decode_time_s`: t_d as the books now know it (default: the configured one)."""
        prefills, decodes = usable(req, prefills), usable(req, decodes)
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            return Rejection("unavailable", f"no live {missing} instance", retry_after_s=1.0)
        choice, route = self._prefill(req, prefills)
        prefill_end = now + choice.ttft_s
        # Decode is chosen for when this request will be on it: from the end of its
        # prefill for t_d (Mooncake's uniform decode time), judged at its busiest, so
        # that admitting it cannot overfill a decode for requests admitted before.
        # Admission judges that decode: as predicted (predictive) or as it is now
        # (early_reject, which cannot see the lag between admission and decoding).
        t_d = self.ctx.params.decode_time_s if decode_time_s is None else decode_time_s
        decode, tbt = choose_decode(req, decodes, prefill_end, self.ctx, prefill_end + t_d)
        if self.admission != "none":
            if choice.ttft_s > req.slo_ttft_s:
                return Rejection(
                    "overloaded",
                    f"predicted TTFT {choice.ttft_s * 1e3:.0f} ms exceeds the SLO of {req.slo_ttft_s * 1e3:.0f} ms",
                    retry_after_s=choice.ttft_s - req.slo_ttft_s, cause="ttft_slo",
                )
            when = prefill_end if self.admission == "predictive" else now
            judged = tbt if self.admission == "predictive" else tbt_at(decode, now, req, self.ctx)
            if judged > req.slo_tbt_s:
                return Rejection(
                    "overloaded",
                    tbt_exceeded(judged, req.slo_tbt_s, decode.instance_id)
                    if judged < math.inf
                    else f"decode instance {decode.instance_id} has no room for it",
                    retry_after_s=self._decode_drain_s(decode, when, now),
                    decode=True, cause="tbt_slo" if judged < math.inf else "no_room",
                )
        return Decision(choice, decode.instance_id, tbt, route)

    def _prefill(self, req: Request, prefills: Sequence[PrefillLoad]) -> tuple[PrefillChoice, Route | None]:
        """The policy's choice among single instances, or a CPP group's (`route_long`)."""
        singles = [x for x in prefills if x.group is None]
        groups = [x for x in prefills if x.group is not None]
        if not singles or not groups:
            return self.policy(req, prefills, self.ctx), None
        return route_long(req, self.policy(req, singles, self.ctx), groups, self.ctx)

    def place_decode(self, req: Request, decodes: Sequence[DecodeLoad], now: float) -> DecodeDecision | Rejection:
        """A decode instance for a request whose prefill is done (its first decode
        refused it or died under it): the lowest predicted TBT now, among those with
        room. No SLO admission: the request was admitted and holds work already, and
        the decode instance double-checks its TBT on arrival anyway."""
        decodes = usable(req, decodes)
        if not decodes:
            return Rejection("unavailable", "no other live decode instance", retry_after_s=1.0)
        decode, tbt = choose_decode(req, decodes, now, self.ctx)
        if tbt == math.inf:
            return Rejection("overloaded", f"decode instance {decode.instance_id} has no room for it",
                             retry_after_s=1.0, cause="no_room")
        return DecodeDecision(decode.instance_id, tbt)

    def _decode_drain_s(self, load: DecodeLoad, t: float, now: float) -> float:
        """Until the first request decoding at t finishes: a fair time to come back."""
        ends = [i.end for i in load.items if i.start <= t < i.end]
        return max(0.0, min(ends) - now) if ends else 1.0


L = TypeVar("L", PrefillLoad, DecodeLoad)


def usable(req: Request, loads: Sequence[L]) -> Sequence[L]:
    """The loads of instances the request does not avoid."""
    if not req.avoid:
        return loads
    return [x for x in loads if x.instance_id not in req.avoid]


def decodes(req: Request) -> bool:
    """Whether decode runs at all: a one-token request ends at prefill."""
    return req.max_tokens > 1


def kv_blocks(req: Request, block_size: int) -> int:
    """The prompt's blocks whose KV prefill sends to decode: every one, its partial
    tail too, when decode runs."""
    return -(-req.prompt_len // block_size) if decodes(req) else 0


def pool_pull(chosen_node: str, chosen_prefix: int, node_prefix: Mapping[str, int]) -> tuple[str, int]:
    """Remote reuse through the store, whatever the policy: the node whose pool holds
    the longest prefix beyond what the chosen instance already has, and how many
    leading blocks to have there after the pull; ("", 0) when no node has more.
    Copying a block between nodes is far cheaper than computing it (a 128-token block
    of an 8B model is 16 MiB: milliseconds over RDMA against tens of ms of GPU time)."""
    best_node, best = "", chosen_prefix
    for node, prefix in sorted(node_prefix.items()):
        if node != chosen_node and prefix > best:
            best_node, best = node, prefix
    return (best_node, best) if best_node else ("", 0)
