"""Wiring of the Conductor: heartbeats keep the live view, request updates keep the
books, and each schedule request gets the policy's answer."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

import structlog
from nats.aio.msg import Msg
from prometheus_client import Histogram

from services.conductor import bookings, fairness
from services.conductor.cpp import PipelineGroup
from services.conductor.index import PoolIndex, PrefixIndex
from services.conductor.metrics import ConductorMetrics
from services.conductor.modes import (
    CONDITIONAL_RULES,
    DISAGGREGATED,
    MODES,
    ColocatedChoice,
    ColocatedLoad,
    LocalPrefill,
    Missing,
    ModeChoice,
    ModeParams,
    choose_mode,
    fallback,
    better_both,
    missing_role,
    place_colocated,
    spill,
    spills,
)
from services.conductor.planner import Arrival, Planner, PlannerParams, planner_timing
from services.conductor.policy import (
    Decision,
    DecodeDecision,
    DecodeLoad,
    Params,
    PrefillLoad,
    Rejection,
    Request,
    Scheduler,
    decodes,
    kv_blocks,
    pool_pull,
    usable,
)
from services.conductor.quotas import Quotas, Refusal
from services.conductor.roles import DRAIN_POLL_S, Roles
from services.conductor.state import ClusterState
from services.conductor.sync import Digest, Peers
from shared import bus, metrics_page, service, tracing
from shared.calibration import quantile_z
from shared.config import ClusterConfig, profile_path
from shared.liveness import Deafness, Registry
from shared.messages import (
    Admission,
    RateLimit,
    BOOK_DIGESTS,
    CONDUCTOR_QUEUE,
    CONDUCTOR_STATS,
    HEARTBEAT,
    KV_EVENTS,
    SCHEDULE,
    BookDigest,
    Booking,
    ConductorStats,
    Heartbeat,
    KvEvent,
    KvSnapshot,
    MessageError,
    MessengerCommand,
    ModeRecord,
    Placement,
    RequestUpdate,
    ScheduleReply,
    ScheduleRequest,
    UpdateBatch,
    encode,
    messenger_subject,
    updates_subject,
)
from shared.predictor import load_predictor
from shared.tenants import TENANTS_ENV, Tenant, Tenants, Watched, in_force

log = structlog.get_logger(__name__)
SLOWDOWN_RANGE = (0.1, 100.0)  # a reported slowdown outside it is a bug, clamped rather than obeyed
KV_FULL = 0.98  # share of a decode engine's KV cache in use beyond which it has no room
HEARING_POLL_S = 0.05  # how often a request held by a just-started Conductor looks again


@dataclass(frozen=True)
class View:
    """The cluster as one schedule request sees it: live instances' loads and nodes,
    and how many of its leading blocks each node's pool holds."""

    prefills: list[PrefillLoad]
    decodes: list[DecodeLoad]
    prefill_nodes: dict[str, str]  # instance → node
    decode_nodes: dict[str, str]
    node_prefix: dict[str, int]

    def node(self, instance_id: str) -> str:
        """Where a live instance of either role runs."""
        return self.decode_nodes.get(instance_id) or self.prefill_nodes[instance_id]


def plausible_slowdown(reported: float) -> float:
    if not math.isfinite(reported):
        return 1.0
    return min(max(reported, SLOWDOWN_RANGE[0]), SLOWDOWN_RANGE[1])


class Conductor:
    """The live Conductor's logic, on the wall clock (time.monotonic)."""

    def __init__(self, config: ClusterConfig, name: str = "conductor",
                 tenants: Watched | Tenants | None = None) -> None:
        self.config = config
        self.tenants = tenants or Tenants()  # whose limits admission holds (shared/tenants.py)
        self.quotas = Quotas()
        self.quota_refusals: dict[tuple[str, str], int] = {}  # (tenant, limit) → requests refused
        self.name = name  # its identity: several Conductors may share the queue group
        predictor = load_predictor(profile_path(config))
        params = Params(block_size=config.block_size, decode_time_s=config.decode_time_s,
                        learn_decode_time=config.learn_decode_time, shortlist=config.shortlist)
        self.scheduler = Scheduler(config.policy, config.admission, predictor, params)
        self.state = ClusterState(predictor, params, PrefixIndex(config.index_capacity_blocks),
                                  calibration_z=quantile_z(config.slo_attainment) if config.calibrate_time_model else None)
        self.listen_tick_s = config.heartbeat_interval_s / 2  # see heard()
        self.registry = Registry(timeout_s=config.liveness_timeout_s,
                                 deafness=Deafness(tick_s=self.listen_tick_s, grace_s=config.heartbeat_interval_s))
        self.pools = PoolIndex(config.pool_index_node_blocks)
        # An engine caps a prompt's chunk while it decodes, whatever role it launched in
        # (its decode requests carry the cap: shared/kv/chunk_cap.py).
        self.decode_chunk_tokens = config.prompt_chunk_tokens("decode")
        self.messenger_nodes: dict[str, str] = {}  # messenger instance → its node
        self.roles_heard: set[str] = set()  # of every instance heard since this Conductor started, live or not
        self.deadlines: dict[str, float] = {}
        self.counts = {"accepted": 0, "wasted_prefill": 0, "replaced_decode": 0}
        self.rejections: dict[str, int] = {}  # by Rejection.cause: all refused, counted once
        self.view_whole_at = float("-inf")  # see listening()
        self.mode_params = mode_params(config)
        self.modes: dict[str, int] = {}  # serving-mode decisions, by ModeChoice.key
        self.routes: dict[str, int] = {}  # CPP group or single instance, by Route.key
        params = PlannerParams(empty_prefill=config.mode == "adaptive", step_tokens=config.step_tokens,
                               chunk_tokens=self.decode_chunk_tokens, **planner_timing(config))
        self.roles = Roles(Planner(predictor, params) if config.planner else None)
        self.mine: set[str] = set()  # requests it placed itself, until they finish
        # With other Conductors (services/conductor/sync.py): what its books took in, for them (Wiring sends it).
        # Random per process, in its digests: the others tell a restart from a pause.
        self.digest = Digest(name, secrets.token_hex(6)) if config.conductors > 1 else None
        self.peers = Peers(timeout_s=config.liveness_timeout_s)
        self.placed_by: dict[str, str] = {}  # the other Conductors' requests in its books → who placed each
        self.peer_bookings = 0  # placements booked from the other Conductors

    def listening(self, now: float) -> None:
        """Heartbeats start arriving now. Until every live instance has sent one (two
        intervals, one of slack), an empty role means 'not heard yet', not 'gone'."""
        self.view_whole_at = now + 2 * self.config.heartbeat_interval_s

    def hearing_instances(self, now: float) -> bool:
        """True while a schedule request should wait rather than be refused for want
        of a live instance: a restarted Conductor has not yet heard the cluster."""
        if now >= self.view_whole_at:
            return False
        roles = ("decode",) if self.config.mode == "colocated" else ("prefill", "decode")
        return not all(self.registry.alive(role, now) for role in roles)

    def heard(self, now: float) -> None:
        """This Conductor is listening now (its wiring says so before each message it
        hands on, and between them): a stall since it last was (its loop blocked,
        heartbeats unread) is not counted as the instances' silence."""
        if deaf_s := self.registry.heard(now):
            self.peers.unheard(deaf_s, now)
            log.warning("conductor loop stalled: instances' silence meanwhile not counted", stalled_ms=round(deaf_s * 1e3))

    def on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """True when `hb` is a messenger this Conductor has not heard from (it just
        started, or the messenger did): its pool's snapshot is wanted."""
        self.roles.watching(now)
        fresh = self.registry.observe(hb, now)
        if fresh:
            # New, back from the dead or restarted: whatever the books hold for it is stale.
            self._forget(hb.instance_id)
            log.info("instance up", instance_id=hb.instance_id, role=hb.role, node=hb.node, pid=hb.pid)
            self.state.add_instance(hb.role, hb.instance_id, self.group(hb))
            self.roles_heard.add(hb.role)
            if hb.role == "messenger":
                self.messenger_nodes[hb.instance_id] = hb.node
        self.expire(now)
        return fresh and hb.role == "messenger"

    def group(self, hb: Heartbeat) -> PipelineGroup | None:
        """A prefill instance of several stages is a CPP group, cutting prompts in the
        cluster's step size. Its stages share a machine here: the hand-over between
        them is a copy, counted as free."""
        if hb.role != "prefill" or hb.stages <= 1:
            return None
        return PipelineGroup(hb.stages, self.config.step_tokens)

    def expire(self, now: float) -> None:
        for gone in self.registry.expire(now):
            log.warning("instance lost", instance_id=gone)
            self._forget(gone)
        # A request whose updates never came (its gateway died) leaves the books at its deadline.
        wall = time.time()
        for rid in [r for r, d in self.deadlines.items() if d < wall]:
            self.finish(rid, now)

    def _forget(self, instance_id: str) -> None:
        """An instance is gone (or restarted): its books, and a messenger's pool blocks."""
        self.state.remove_instance(instance_id)
        self.roles.forget(instance_id)
        node = self.messenger_nodes.pop(instance_id, None)
        if node is not None:
            self.pools.remove_node(node)

    def on_kv_event(self, event: KvEvent) -> None:
        if event.node not in self.messenger_nodes.values():  # a departed node's late event (its snapshot covers a new one)
            return
        if event.kind == "stored":
            self.pools.stored(event.node, event.tier, event.hashes)
        elif event.kind == "evicted":
            self.pools.evicted(event.node, event.tier, event.hashes)
        else:
            self.pools.removed(event.node, event.hashes)

    def on_snapshot(self, snap: KvSnapshot) -> None:
        self.pools.replace_node(snap.node, {"dram": snap.dram, "ssd": snap.ssd})
        log.info("pool index rebuilt", node=snap.node, dram=len(snap.dram), ssd=len(snap.ssd), blocks=len(self.pools))

    def stats(self, now: float) -> ConductorStats:
        return ConductorStats(
            accepted=self.counts["accepted"], rejected=self.rejected, wasted_prefill=self.counts["wasted_prefill"],
            pool_blocks=len(self.pools), pool_nodes=sorted(set(self.messenger_nodes.values())),
            decode_time_ms=self.state.decode_time_s * 1e3,
            slowdown=self.slowdowns(now),
            rejections=dict(self.rejections),
            modes=dict(self.modes),
            routes=dict(self.routes),
            roles=dict(self.roles.assigned),
            draining=dict(self.roles.draining),
            role_changes=self.roles.changes,
            conductor=self.name,
            booked=bookings.per_instance(self.state),
            peer_bookings=self.peer_bookings,
        )

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())

    def view_now(self, now: float) -> View:
        """The live instances' loads, for no request in particular (stats and /metrics)."""
        return self._view([], now)

    def slowdowns(self, now: float) -> dict[str, float]:
        view = self.view_now(now)
        return {x.instance_id: round(x.slowdown, 3) for x in (*view.prefills, *view.decodes)}

    def schedule(self, ask: ScheduleRequest, now: float) -> ScheduleReply:
        req = Request(
            request_id=ask.request_id,
            prompt_len=ask.prompt_len,
            prompt_blocks=len(ask.block_hashes),
            max_tokens=ask.max_tokens,
            slo_ttft_s=(ask.slo_ttft_ms or self.config.slo_ttft_ms) / 1e3,
            slo_tbt_s=(ask.slo_tbt_ms or self.config.slo_tbt_ms) / 1e3,
            avoid=frozenset(ask.avoid),
        )
        view = self._view(ask.block_hashes, now, self.scheduler.shortlist, req.avoid)
        if ask.stage == "decode":
            return self._schedule_decode(req, ask, view, now)
        tenants = self._tenants()
        # A retry is the same request: counted once, at its first ask. With no tenants
        # file there is nothing to count against (one tenant, no limits, no shares).
        counted = not ask.avoid and not tenants.open
        tenant = tenants.get(ask.tenant)
        if counted and (refusal := self.quotas.check(tenant, ask.prompt_len + ask.max_tokens, now)) is not None:
            return self._over_quota(req, tenant, refusal, now)
        reply = self._schedule_new(req, ask, view, now)
        if counted and reply.accepted:
            reply.limits = self._count(ask, tenant, now)
        held = max((x.prefix_blocks for x in view.prefills), default=0) * self.config.block_size
        # Its output is not known yet (max_tokens is only a bound): the planner prices
        # decode by the learned t_d instead (Observation.decode_time_s).
        self.roles.arrived(Arrival(now, req.prompt_len - min(held, req.prompt_len - 1), req.prompt_len, 0))
        return reply

    def _schedule_new(self, req: Request, ask: ScheduleRequest, view: View, now: float) -> ScheduleReply:
        if self.config.mode == "colocated":
            return self._schedule_colocated(req, ask, view, now)
        missing = missing_role(len(usable(req, view.prefills)), len(usable(req, view.decodes)))
        if missing is not None:
            return self._schedule_fallback(req, ask, view, missing, now)
        out = self.scheduler.schedule(req, view.prefills, view.decodes, now, self.state.decode_time_s)
        log.debug("decision", request_id=req.request_id, request=req, prefills=view.prefills, decodes=view.decodes, out=out)
        if isinstance(out, Decision) and (refused := self._unfair(req, ask, out.prefill.ttft_s, out.tbt_s, now)) is not None:
            return self._rejected(req, refused, now)
        if self.config.mode == "adaptive" and spills(out, req):
            return self._spill(req, ask, view, out, now)
        if not isinstance(out, Decision):
            return self._rejected(req, out, now)
        return self._schedule_disaggregated(req, ask, view, out, now)

    def _schedule_disaggregated(self, req: Request, ask: ScheduleRequest, view: View, out: Decision,
                                now: float) -> ScheduleReply:
        choice = DISAGGREGATED
        if self.config.mode == "conditional":
            x = self._local_prefill(req, ask.block_hashes, out.decode_id, out.prefill.ttft_s, view, now)
            choice = choose_mode(x, self.state.predictor, self.mode_params)
            if choice.local:
                return self._accept_local(req, ask, out.decode_id, x.uncached_tokens, choice, view, now)
        # A record the rule left without predictions gets the placement's own.
        choice = replace(choice, ttft_s=choice.ttft_s or out.prefill.ttft_s, tbt_s=choice.tbt_s or out.tbt_s)
        self._accepted(req, ask, choice)
        if out.route is not None:
            self.routes[out.route.key] = self.routes.get(out.route.key, 0) + 1
            log.debug("prefill route", request_id=req.request_id, route=out.route.key, detail=out.route.detail)
        return ScheduleReply(
            request_id=req.request_id,
            accepted=True,
            placement=self._place(req, ask.block_hashes, out, view, now),
            predicted_ttft_ms=out.prefill.ttft_s * 1e3,
            predicted_tbt_ms=out.tbt_s * 1e3,
            mode=ModeRecord(**choice.record()),
            route=out.route.key if out.route else "",
        )

    def _accepted(self, req: Request, ask: ScheduleRequest, choice: ModeChoice) -> None:
        self.counts["accepted"] += 1
        self.deadlines[req.request_id] = ask.deadline
        self._count_mode(req, choice)

    def _count_mode(self, req: Request, choice: ModeChoice) -> None:
        self.modes[choice.key] = self.modes.get(choice.key, 0) + 1
        log.debug("serving mode", request_id=req.request_id, **choice.record())

    def _schedule_colocated(self, req: Request, ask: ScheduleRequest, view: View, now: float) -> ScheduleReply:
        """Every instance prefills and decodes: the least delay among them (modes.place_colocated)."""
        loads = [self._colocated_load(x, ask.block_hashes, view, now) for x in view.decodes]
        out = place_colocated(req, loads, self.state.predictor, self.config.block_size, self.config.step_tokens,
                              self.config.admission)
        if not isinstance(out, ColocatedChoice):
            return self._rejected(req, out, now)
        return self._accept_both(req, ask, out, out.choice(), view, now)

    def _schedule_fallback(self, req: Request, ask: ScheduleRequest, view: View, missing: str,
                           now: float) -> ScheduleReply:
        """Degrade rather than refuse: with no live instance of the `missing` role, the
        other role's instances prefill and decode, placed as colocated ones are."""
        out = self._both_phases(req, ask, view, self._hosts(missing, view, now), now)
        if not isinstance(out, ColocatedChoice):
            return self._rejected(req, out, now)
        choice = fallback(missing, out.instance_id, out.tbt_s, out.ttft_s, self._why_missing(missing, now))
        if choice.rule == "fallback":
            log.info("degraded", request_id=req.request_id, host=out.instance_id, reason=choice.reason)
        return self._accept_both(req, ask, out, choice, view, now)

    def _why_missing(self, role: str, now: float) -> Missing:
        """Why `role` has no live instance: the planner moved them, they died (one was
        heard since this Conductor started), or none was launched."""
        if self.roles.emptied(role, self.engines(now)):  # type: ignore[arg-type]
            return "planner"
        return "died" if role in self.roles_heard else "none"

    def _spill(self, req: Request, ask: ScheduleRequest, view: View, disaggregated: Decision | Rejection,
               now: float) -> ScheduleReply:
        """Adaptive mode: a request disaggregation would refuse, or would keep waiting in
        a prefill queue, goes to whichever instance (a decode's batch, a prefill's own
        engine) serves it sooner within its SLOs; it is refused only if none can."""
        out = self._both_phases(req, ask, view, [*view.decodes, *self._hosts("decode", view, now)], now)
        if not isinstance(out, ColocatedChoice) or not better_both(out, disaggregated, req):
            if isinstance(disaggregated, Decision):
                return self._schedule_disaggregated(req, ask, view, disaggregated, now)
            return self._rejected(req, disaggregated, now)
        if isinstance(disaggregated, Rejection) and disaggregated.decode:
            self.roles.refused_for_decode(now)  # spilled, yet decode lacked room: the planner's signal
        why = (disaggregated.reason if isinstance(disaggregated, Rejection)
               else f"its prefill queue would take {disaggregated.prefill.ttft_s * 1e3:.0f} ms")
        choice = spill(out.instance_id, why, out.tbt_s, out.ttft_s)
        log.info("spilled", request_id=req.request_id, host=out.instance_id, instead_of=why)
        return self._accept_both(req, ask, out, choice, view, now)

    def _both_phases(self, req: Request, ask: ScheduleRequest, view: View, hosts: list[DecodeLoad],
                     now: float) -> ColocatedChoice | Rejection:
        """The host among `hosts` that would prefill and decode the request soonest, as colocated placement picks."""
        queues = {x.instance_id: x.queue_s for x in view.prefills}  # a prefill instance's own work comes first
        loads = [replace(self._colocated_load(x, ask.block_hashes, view, now), queue_s=queues.get(x.instance_id, 0.0),
                         prefill_role=x.instance_id in queues, pooled=not queues) for x in hosts]
        return place_colocated(req, loads, self.state.predictor, self.config.block_size, self.config.step_tokens,
                               self.config.admission)

    def _accept_both(self, req: Request, ask: ScheduleRequest, out: ColocatedChoice, choice: ModeChoice, view: View,
                     now: float) -> ScheduleReply:
        if (refused := self._unfair(req, ask, out.ttft_s, out.mixed_tbt_s, now)) is not None:
            return self._rejected(req, refused, now)
        cached = min(out.cached_blocks * self.config.block_size, req.prompt_len - 1)
        return self._accept_local(req, ask, out.instance_id, req.prompt_len - cached, choice, view, now)

    def _hosts(self, missing: str, view: View, now: float) -> list[DecodeLoad]:
        """The instances that decode while `missing` has none live, with their decode
        books: decode instances, or single (not CPP-group) prefill instances."""
        if missing == "prefill":
            return view.decodes
        return [replace(self.state.decode_load(x.instance_id, now), decode_chunk_tokens=self.decode_chunk_tokens)
                for x in view.prefills if x.group is None]

    def _colocated_load(self, load: DecodeLoad, hashes: list[str], view: View, now: float) -> ColocatedLoad:
        batch, ctx_tokens = load.at(now)
        return ColocatedLoad(load.instance_id, self.state.local_queued(load.instance_id),
                             self._decode_prefix(hashes, load.instance_id, view), batch, ctx_tokens,
                             capacity=load.capacity, slowdown=load.slowdown,
                             decode_chunk_tokens=load.decode_chunk_tokens)

    def _decode_prefix(self, hashes: list[str], decode_id: str, view: View) -> int:
        """What an instance would not compute: its engine's cache, or its node's pool."""
        return max(self.state.decode_prefix(hashes, decode_id), view.node_prefix.get(view.node(decode_id), 0))

    def _local_prefill(self, req: Request, hashes: list[str], decode_id: str, remote_ttft_s: float,
                       view: View, now: float) -> LocalPrefill:
        """The chosen decode instance as conditional's rule judges it, now."""
        load = next(x for x in view.decodes if x.instance_id == decode_id)
        batch, ctx_tokens = load.at(now)
        cached = min(self._decode_prefix(hashes, decode_id, view) * self.config.block_size, req.prompt_len - 1)
        return LocalPrefill(decode_id, req.prompt_len - cached, cached, batch, ctx_tokens, req.slo_tbt_s,
                            slowdown=load.slowdown, remote_ttft_s=remote_ttft_s)

    def _accept_local(self, req: Request, ask: ScheduleRequest, decode_id: str, uncached_tokens: int,
                      choice: ModeChoice, view: View, now: float) -> ScheduleReply:
        """The request's decode instance prefills it, in its batch."""
        self._accepted(req, ask, choice)
        self._book(bookings.local(self.name, req, ask.block_hashes, ask.deadline, decode_id, uncached_tokens,
                                  choice.ttft_s), now)
        placement = Placement(prefill_id="", decode_id=decode_id, decode_node=view.node(decode_id), local_prefill=True,
                              conductor=self.name)
        return ScheduleReply(request_id=req.request_id, accepted=True, placement=placement,
                             predicted_ttft_ms=choice.ttft_s * 1e3, predicted_tbt_ms=choice.tbt_s * 1e3,
                             mode=ModeRecord(**choice.record()))

    def _unfair(self, req: Request, ask: ScheduleRequest, ttft_s: float, tbt_s: float, now: float) -> Rejection | None:
        """Past the loaded mark, the room left goes by the tenants' classes and shares
        (services/conductor/fairness.py); one tenant alone is never held back. Every
        way in is judged (a placement's predicted TTFT and TBT): a request fairness
        holds back must not get in as a spill onto a decode's batch instead. A retry
        was judged at its first ask."""
        tenants = self._tenants()
        if tenants.open or ask.avoid:
            return None
        pressure = max(ttft_s / req.slo_ttft_s if req.slo_ttft_s > 0 else 0.0,
                       tbt_s / req.slo_tbt_s if req.slo_tbt_s > 0 else 0.0)
        loads = self.quotas.loads(now)
        refused = fairness.judge(self._tenant(ask.tenant), pressure, loads,
                                 {t: tenants.get(t).weight for t in loads}, self.config.fair_share_mark)
        if refused is None:
            return None
        return Rejection("overloaded", refused.reason, retry_after_s=1.0, cause=refused.cause)

    def _tenants(self) -> Tenants:
        return in_force(self.tenants)

    def _tenant(self, tenant_id: str) -> Tenant:
        return self._tenants().get(tenant_id)

    def _over_quota(self, req: Request, tenant: Tenant, refusal: Refusal, now: float) -> ScheduleReply:
        """A 429 of the tenant's own making: its quota, not the cluster's load."""
        self.rejections["quota"] = self.rejections.get("quota", 0) + 1
        key = (tenant.id, refusal.limit)
        self.quota_refusals[key] = self.quota_refusals.get(key, 0) + 1
        log.info("over quota", request_id=req.request_id, tenant=tenant.id, quota=refusal.limit, bound=refusal.bound)
        return ScheduleReply(request_id=req.request_id, accepted=False, rejection="quota", quota=refusal.limit,
                             reason=refusal.reason, retry_after_s=refusal.reset_s,
                             limits=self._limits(tenant, now, refusal))

    def _count(self, ask: ScheduleRequest, tenant: Tenant, now: float) -> list[RateLimit]:
        """An admitted request against its tenant's quotas, here and, by the digest, at the others."""
        a = Admission(tenant=tenant.id, request_id=ask.request_id, tokens=ask.prompt_len + ask.max_tokens,
                      deadline=ask.deadline)
        self.on_admission(a, now)
        if self.digest is not None:
            self.digest.admitted(a, now)
        return self._limits(tenant, now)

    def on_admission(self, a: Admission, now: float) -> None:
        """A request admitted against its tenant's quotas (a peer's: dated back by its age)."""
        self.quotas.admitted(a.tenant, a.request_id, a.tokens, now, now + max(0.0, a.deadline - time.time()))

    def _limits(self, tenant: Tenant, now: float, refusal: Refusal | None = None) -> list[RateLimit]:
        left = self.quotas.remaining(tenant, now)
        reset = refusal.reset_s if refusal is not None else 0.0
        return [RateLimit(name=name, limit=getattr(tenant, f"{name}_per_minute"), remaining=n,  # type: ignore[arg-type]
                          reset_s=reset if refusal is not None and refusal.limit == name else self.quotas.reset(tenant.id, now))
                for name, n in left.items()]

    def _rejected(self, req: Request, out: Rejection, now: float) -> ScheduleReply:
        self.rejections[out.cause] = self.rejections.get(out.cause, 0) + 1
        if out.decode:
            self.roles.refused_for_decode(now)
        return ScheduleReply(
            request_id=req.request_id, accepted=False, rejection=out.kind, reason=out.reason, retry_after_s=out.retry_after_s
        )

    def _schedule_decode(self, req: Request, ask: ScheduleRequest, view: View, now: float) -> ScheduleReply:
        """A decode instance alone, for a request retried after its prefill; its books
        start decoding now. Counted apart: the request was accepted once already."""
        degraded = not usable(req, view.decodes)  # no decode instance left for it: a prefill instance decodes
        hosts = self._hosts("decode", view, now) if degraded else view.decodes
        out = self.scheduler.place_decode(req, hosts, now)
        if not isinstance(out, DecodeDecision):
            return self._rejected(req, out, now)
        self.counts["replaced_decode"] += 1
        self._book(bookings.decode_only(self.name, req, ask.deadline, out.decode_id), now)
        mode = None
        if degraded:
            choice = fallback("decode", out.decode_id, tbt_s=out.tbt_s)
            self._count_mode(req, choice)
            log.info("degraded", request_id=req.request_id, host=out.decode_id, reason=choice.reason)
            mode = ModeRecord(**choice.record())
        placement = Placement(prefill_id="", decode_id=out.decode_id, decode_node=view.node(out.decode_id),
                              conductor=self.name)
        return ScheduleReply(request_id=req.request_id, accepted=True, placement=placement,
                             predicted_tbt_ms=out.tbt_s * 1e3, mode=mode)

    def engines(self, now: float) -> list[Heartbeat]:
        """The engine instances requests may be placed on: alive and not stopping."""
        return [hb for role in ("prefill", "decode") for hb in self.registry.alive(role, now) if not hb.draining]

    def _view(self, hashes: list[str], now: float, shortlist: int = 0, avoid: frozenset[str] = frozenset()) -> View:
        """The live instances' loads for a request with these block hashes, each
        instance in the role it serves now (roles.py: a moving one in neither): all
        of them, or the policy's shortlist among those the request does not avoid."""
        engines = self.engines(now)
        prefill_nodes = {hb.instance_id: hb.node for hb in engines if self.roles.of(hb) == "prefill"}
        live_decode = {hb.instance_id: hb for hb in engines if self.roles.of(hb) == "decode"}
        node_prefix = self.pools.prefix_blocks(hashes, set(self.messenger_nodes.values()))
        pool_prefix = {iid: node_prefix.get(node, 0) for iid, node in prefill_nodes.items()}
        prefills = self.state.prefill_loads(hashes, now, pool_prefix, shortlist,
                                            skip=lambda iid: iid not in prefill_nodes or iid in avoid)
        decodes = [self._as_reported(x, live_decode[x.instance_id]) for x in self.state.decode_loads(
            now, shortlist, skip=lambda iid: iid not in live_decode or iid in avoid)]
        decode_nodes = {iid: hb.node for iid, hb in live_decode.items()}
        return View(prefills, decodes, prefill_nodes, decode_nodes, node_prefix)

    def _place(self, req: Request, hashes: list[str], out: Decision, view: View, now: float) -> Placement:
        """The placement the gateway executes, with the books charged for it."""
        # Remote reuse goes through the node pools whatever the policy: decide the pull
        # here, once, and charge the books for the pull that is sent (the blocks it
        # saves and its transfer), not for the policy's own idea of one.
        chosen_node = view.prefill_nodes[out.prefill.instance_id]
        prefix = next(x.prefix_blocks for x in view.prefills if x.instance_id == out.prefill.instance_id)
        pull_node, pull_blocks = pool_pull(chosen_node, prefix, view.node_prefix)
        sent = replace(out.prefill, cached_blocks=max(prefix, pull_blocks), pull_from=pull_node,
                       pull_blocks=max(0, pull_blocks - prefix))
        deadline = self.deadlines.get(req.request_id, 0.0)
        self._book(bookings.disaggregated(self.name, req, hashes, deadline, replace(out, prefill=sent)), now)
        return Placement(
            prefill_id=out.prefill.instance_id,
            decode_id=out.decode_id,
            decode_node=view.decode_nodes[out.decode_id] if decodes(req) else "",
            conductor=self.name,
            kv_blocks=kv_blocks(req, self.config.block_size),
            pull_from=pull_node,
            pull_blocks=pull_blocks,
            # Only what the prefill node's pool lacks travels (its engine's own cache may hold more).
            pull_skip=min(view.node_prefix.get(chosen_node, 0), pull_blocks),
        )

    def _as_reported(self, load: DecodeLoad, hb: Heartbeat) -> DecodeLoad:
        """The books' load, with what only the instance knows: a decode engine that
        reports its KV cache full takes nobody new, whatever the books say (they only
        know what this Conductor sent it), and its steps run at the pace it measures."""
        capacity = min(load.capacity, len(load.items)) if hb.kv_usage >= KV_FULL else load.capacity
        slowdown = plausible_slowdown(hb.slowdown) if self.config.calibrate_time_model else 1.0
        return replace(load, capacity=capacity, slowdown=slowdown, decode_chunk_tokens=self.decode_chunk_tokens)

    def _book(self, b: Booking, now: float) -> None:
        """One of its own placements: into its books, and into the digest for the others."""
        self._take(b, now)
        self.mine.add(b.request_id)
        if self.digest is not None:
            self.digest.booked(b, now)

    def on_booking(self, b: Booking, now: float) -> None:
        """Another Conductor's placement: booked here as it was there."""
        if b.conductor != self.name and bookings.knows(self.state, b):
            self._take(b, now)
            self.placed_by[b.request_id] = b.conductor
            self.peer_bookings += 1

    def _take(self, b: Booking, now: float) -> None:
        bookings.book(self.state, b, now, conditional=self.config.mode == "conditional")
        self.deadlines[b.request_id] = b.deadline

    def on_digest(self, d: BookDigest, now: float) -> None:
        """Another Conductor's news: its placements booked here as there, then its
        requests' updates, each dated when it was taken there."""
        if d.conductor == self.name:
            return
        if self.peers.heard(d.conductor, d.incarnation, now):
            self._forget_peer(d.conductor, now, "conductor restarted: its earlier placements leave the books")
        for b in d.bookings:
            self.on_booking(b, now - b.age_s)
        for u in d.updates:
            self.on_update(u, now - u.age_s, own=False)
        for a in d.admissions:
            self.on_admission(a, now - a.age_s)

    def forget_lost_peers(self, now: float) -> None:
        """A Conductor whose digests stopped: its placements leave the books (sync.py)."""
        for peer in self.peers.lost(now):
            self._forget_peer(peer, now, "conductor lost: its placements leave the books")

    def _forget_peer(self, peer: str, now: float, why: str) -> None:
        theirs = [rid for rid, by in self.placed_by.items() if by == peer]
        for rid in theirs:
            self.finish(rid, now)
        log.warning(why, conductor=peer, requests=len(theirs))

    def on_update(self, update: RequestUpdate, now: float, own: bool = True) -> None:
        """A request's progress. `own`: it came on this Conductor's updates subject, so
        the others hear of it only through its digest."""
        if own and self.digest is not None:
            self.digest.updated(update, now)
        if update.kind == "prefill_done":
            self.state.prefill_done(update.request_id, now)
            return
        if update.kind == "decode_refused" and update.request_id in self.mine:  # counted where it was placed
            self.counts["wasted_prefill"] += 1
            self.roles.refused_for_decode(now)
            log.warning("wasted prefill: decode refused", request_id=update.request_id, decode=update.instance_id)
        self.finish(update.request_id, now, completed=update.kind == "finished" and update.completed,
                    tokens=update.tokens)

    def finish(self, request_id: str, now: float, completed: bool = False, tokens: int = -1) -> None:
        self.quotas.finished(request_id, tokens)
        self.deadlines.pop(request_id, None)
        self.mine.discard(request_id)
        self.placed_by.pop(request_id, None)
        self.state.finished(request_id, now, completed)

    def plan(self, now: float) -> None:
        """The planner's turn (config.planner): finished drains take their new role,
        and it may start moves."""
        engines = self.engines(now)
        decodes = [hb for hb in engines if self.roles.of(hb) == "decode"]
        slowdown = sum(plausible_slowdown(hb.slowdown) for hb in decodes) / len(decodes) if decodes else 1.0
        slo = (self.config.slo_tbt_ms or 1e9) / 1e3
        wanted = self.roles.planner.wanted if self.roles.planner else None
        self.roles.plan(now, engines, self.state, slo, slowdown if self.config.calibrate_time_model else 1.0)
        planner = self.roles.planner
        if planner is not None and planner.wanted != wanted:  # once per change: why a role moved, or never did
            judged = planner.judged.summary() if planner.judged else "no arrivals"
            log.info("planner wants", role=planner.wanted or "no move", streak=planner.streak,
                     confirm=planner.params.confirm, slowdown=round(slowdown, 2), demand=judged)

    def settle_roles(self) -> None:
        """Between the planner's turns: draining instances whose old work is done take their new role."""
        self.roles.settle(self.state)


def mode_params(config: ClusterConfig) -> ModeParams:
    """The serving mode's settings, checked: an unknown name stops the Conductor at start."""
    if config.mode not in MODES:
        raise ValueError(f"unknown mode {config.mode!r}; choose from {', '.join(MODES)}")
    if config.conditional_rule not in CONDITIONAL_RULES:
        raise ValueError(f"unknown conditional rule {config.conditional_rule!r}; choose from {', '.join(CONDITIONAL_RULES)}")
    return ModeParams(config.conditional_rule, config.step_tokens, config.local_prefill_tokens)


def decision_attributes(reply: ScheduleReply) -> dict[str, str | bool]:
    """The decision as its span records it: where, in which mode and why, or why not."""
    if not reply.accepted or reply.placement is None:
        return {"yuebing.accepted": False, "yuebing.reason": reply.reason}
    p = reply.placement
    mode = f"{reply.mode.mode}:{reply.mode.reason}" if reply.mode else ""
    return {"yuebing.accepted": True, "yuebing.prefill": p.prefill_id, "yuebing.decode": p.decode_id,
            "yuebing.mode": mode, "yuebing.reason": reply.mode.detail if reply.mode else ""}


def parser() -> argparse.ArgumentParser:
    p = service.parser("conductor", instance=False)
    p.add_argument("--instance-id", default="conductor",
                   help="its identity, [A-Za-z0-9_-]: one per Conductor where several share the cluster")
    p.add_argument("--tenants", default=os.environ.get(TENANTS_ENV),
                   help="owner-only tenants file (docs/tenants.md; default: $YUEBING_TENANTS_FILE), the gateways' "
                        "too: their quotas, read again when it changes")
    metrics_page.add_arguments(p)
    return p


class Wiring:
    """The Conductor on NATS: each subject's handler calls into `Conductor` with the
    wall clock; the snapshot requests and digest sends it starts are its tasks,
    cancelled on close."""

    def __init__(self, conductor: Conductor, nc: Any, decision: Histogram | None = None) -> None:
        self.conductor = conductor
        self.nc = nc
        self.decision = decision  # each decision's time, for /metrics
        self.tasks: set[asyncio.Task[None]] = set()
        self.planning: asyncio.Task[None] | None = None
        self.listening: asyncio.Task[None] | None = None
        self.sync_s = conductor.config.conductor_sync_ms / 1e3
        self.sync_timer: asyncio.TimerHandle | None = None  # see sync.py: fires only while the loop is quiet
        self.sync_timer_at = 0.0

    async def start(self) -> None:
        await bus.subscribe(self.nc, HEARTBEAT, Heartbeat, self.on_heartbeat)
        self.conductor.listening(time.monotonic())
        await bus.subscribe(self.nc, updates_subject(self.conductor.name), UpdateBatch, self.on_updates)
        await bus.subscribe(self.nc, KV_EVENTS, KvEvent, self.on_kv_event)
        if self.conductor.digest is not None:
            await bus.subscribe(self.nc, BOOK_DIGESTS, BookDigest, self.on_digest)
            now = time.monotonic()
            self._set_timer(now, now)  # its first beat, at once
        await self.nc.subscribe(CONDUCTOR_STATS, cb=self.on_stats)
        await bus.subscribe(self.nc, SCHEDULE, ScheduleRequest, self.on_schedule, queue=CONDUCTOR_QUEUE)
        self.listening = asyncio.create_task(self.listen_forever(self.conductor.listen_tick_s), name="listening")
        if self.conductor.roles.planner is not None:
            self.planning = asyncio.create_task(self.plan_forever(self.conductor.roles.planner.params.interval_s),
                                                name="planner")

    async def plan_forever(self, interval_s: float) -> None:
        """The planner's turn every `interval_s`; between turns, drains are checked
        every DRAIN_POLL_S, so a drained instance takes its new role within a second."""
        turn_at = time.monotonic() + interval_s
        while True:
            await asyncio.sleep(min(DRAIN_POLL_S, interval_s))
            try:
                now = time.monotonic()
                self.conductor.heard(now)
                if now >= turn_at:
                    turn_at = now + interval_s
                    self.conductor.plan(now)
                elif self.conductor.roles.draining:
                    self.conductor.settle_roles()
            except Exception:  # a bug in one turn must not stop the planner for good
                log.exception("planner failed")

    async def listen_forever(self, tick_s: float) -> None:
        """Ticks between messages, so that a quiet cluster's gaps are not taken for stalls."""
        while True:
            await asyncio.sleep(tick_s)
            self.conductor.heard(time.monotonic())

    async def sync(self, now: float, wait_s: float) -> None:
        """Its digest to the other Conductors, if due `wait_s` after the last send (a
        handler's: one interval; the timer's: 0), then the timer set for when no handler
        will have sent it (sync.py). Each send (at most one an interval) also forgets the
        placements of Conductors gone silent: not every message need look."""
        digest = self.conductor.digest
        if digest is None:  # no other Conductor
            return
        beat_s = self.conductor.config.heartbeat_interval_s
        if digest.due(now, wait_s, beat_s):
            self.conductor.forget_lost_peers(now)
            out = digest.take(now)
            try:
                await bus.publish(self.nc, BOOK_DIGESTS, out)
            except Exception as e:  # NATS down a while: the next digest carries it
                digest.put_back(out, now)
                log.warning("books not synced", error=str(e) or type(e).__name__)
        self._set_timer(digest.timer_at(self.sync_s, beat_s), now)

    def _set_timer(self, at: float, now: float) -> None:
        if self.sync_timer is not None and self.sync_timer_at == at:
            return
        if self.sync_timer is not None:
            self.sync_timer.cancel()
        self.sync_timer, self.sync_timer_at = asyncio.get_running_loop().call_later(max(0.0, at - now), self._timed), at

    def _timed(self) -> None:
        self.sync_timer = None
        task = asyncio.get_running_loop().create_task(self.sync(time.monotonic(), wait_s=0.0), name="sync")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        if self.sync_timer is not None:
            self.sync_timer.cancel()
        tasks = [*self.tasks, *(t for t in (self.planning, self.listening) if t)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def fetch_snapshot(self, node: str) -> None:
        """A messenger we have not heard from: take its whole pool as the truth."""
        ask = MessengerCommand(op="snapshot")
        for attempt in range(3):
            try:
                snapshot = await bus.request(self.nc, messenger_subject(node), ask, KvSnapshot, timeout=2.0)
                self.conductor.on_snapshot(snapshot)
                return
            except (TimeoutError, MessageError) as e:
                log.warning("pool snapshot failed", node=node, attempt=attempt, error=str(e))

    async def on_heartbeat(self, hb: Heartbeat, _msg: Any) -> None:
        now = time.monotonic()
        self.conductor.heard(now)
        if self.conductor.on_heartbeat(hb, now):
            task = asyncio.create_task(self.fetch_snapshot(hb.node), name=f"snapshot-{hb.node}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def on_kv_event(self, event: KvEvent, _msg: Any) -> None:
        self.conductor.on_kv_event(event)

    async def on_stats(self, msg: Msg) -> None:
        await msg.respond(encode(self.conductor.stats(time.monotonic())))

    async def on_updates(self, batch: UpdateBatch, _msg: Any) -> None:
        now = time.monotonic()
        for update in batch.updates:
            self.conductor.on_update(update, now)
        await self.sync(now, self.sync_s)

    async def on_digest(self, d: BookDigest, _msg: Any) -> None:
        self.conductor.on_digest(d, time.monotonic())

    async def on_schedule(self, ask: ScheduleRequest, msg: Msg) -> None:
        while self.conductor.hearing_instances(time.monotonic()):
            await asyncio.sleep(HEARING_POLL_S)
        start = time.monotonic()
        self.conductor.heard(start)
        with (structlog.contextvars.bound_contextvars(request_id=ask.request_id, tenant=ask.tenant),
              tracing.span("conductor.decide", ask.request_id, prompt_tokens=ask.prompt_len, tenant=ask.tenant) as span):
            reply = self.conductor.schedule(ask, start)  # its lines (spilled, degraded, over quota) name both
            if span.is_recording():
                span.set_attributes(decision_attributes(reply))
        if self.decision is not None:
            self.decision.observe(time.monotonic() - start)
        placement = reply.placement
        log.info(
            "scheduled" if reply.accepted else "rejected",
            request_id=ask.request_id,
            tenant=ask.tenant,
            prefill=placement.prefill_id if placement else None,
            decode=placement.decode_id if placement else None,
            mode=f"{reply.mode.mode}:{reply.mode.reason}" if reply.mode else None,
            route=reply.route or None,
            ttft_ms=round(reply.predicted_ttft_ms, 1),
            pull_from=(placement.pull_from or None) if placement else None,
            reason=reply.reason or None,
            prompt_len=ask.prompt_len,
            stage=ask.stage if ask.stage != "full" else None,
            avoid=ask.avoid or None,
        )
        await msg.respond(encode(reply))
        await self.sync(time.monotonic(), self.sync_s)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    try:
        tenants = Watched.open(args.tenants) if args.tenants else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"conductor: tenants: {e}") from e
    conductor = Conductor(config, args.instance_id, tenants)
    metrics = ConductorMetrics(conductor)
    page = await metrics_page.serve_for(args, metrics.registry, "conductor")
    # No echo: its own bookings (BOOKINGS, which it also listens to) never come back to it.
    nc = await bus.connect(config.nats_url, args.instance_id, args.nats_credentials, no_echo=True)
    wiring = Wiring(conductor, nc, metrics.decision)
    await wiring.start()
    watch = asyncio.create_task(tenants.watch(stop)) if tenants is not None else None
    # The books' tables exist now: frozen, a full collection never walks their entries
    # again (a million, in time: `yuebing bench conductor` times such a walk).
    service.freeze_heap()
    log.info("conductor ready", policy=config.policy, admission=config.admission, profile=str(profile_path(config)))
    await stop.wait()
    log.info("conductor stopping", rejected=conductor.rejected, **conductor.counts)
    if watch is not None:
        watch.cancel()
    await wiring.close()
    await bus.close(nc)
    if page is not None:
        await page.cleanup()
