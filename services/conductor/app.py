"""Wiring of the Conductor: heartbeats keep the live view, request events keep the
books, and each schedule request gets the policy's answer."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import structlog
from nats.aio.msg import Msg

from services.conductor.index import PrefixIndex
from services.conductor.policy import Decision, DecodeLoad, Params, Request, Scheduler
from shared.predictor import load_predictor
from services.conductor.state import ClusterState
from shared import bus, service
from shared.config import ClusterConfig, profile_path
from shared.liveness import Registry
from shared.messages import (
    CONDUCTOR_QUEUE,
    HEARTBEAT,
    REQUEST_EVENTS,
    SCHEDULE,
    Heartbeat,
    RequestEvent,
    ScheduleReply,
    ScheduleRequest,
    encode,
)

log = structlog.get_logger(__name__)
KV_FULL = 0.98  # share of a decode engine's KV cache in use beyond which it has no room


class Conductor:
    """The live Conductor's logic, on the wall clock (time.monotonic)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        predictor = load_predictor(profile_path(config))
        params = Params(block_size=config.block_size, decode_time_s=config.decode_time_s)
        self.scheduler = Scheduler(config.policy, config.admission, predictor, params)
        self.state = ClusterState(predictor, params, PrefixIndex(config.index_capacity_blocks))
        self.registry = Registry(timeout_s=config.liveness_timeout_s)
        self.deadlines: dict[str, float] = {}
        self.counts = {"accepted": 0, "rejected": 0, "wasted_prefill": 0}

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        if self.registry.observe(hb, now):
            log.info("instance up", instance_id=hb.instance_id, role=hb.role, node=hb.node)
            self.state.add_instance(hb.role, hb.instance_id)
        self.expire(now)

    def expire(self, now: float) -> None:
        for gone in self.registry.expire(now):
            log.warning("instance lost", instance_id=gone)
            self.state.remove_instance(gone)
        # A request whose events never came (its gateway died) leaves the books at its deadline.
        wall = time.time()
        for rid in [r for r, d in self.deadlines.items() if d < wall]:
            self.finish(rid, now)

    def schedule(self, ask: ScheduleRequest, now: float) -> ScheduleReply:
        req = Request(
            request_id=ask.request_id,
            prompt_len=ask.prompt_len,
            prompt_blocks=len(ask.block_hashes),
            max_tokens=ask.max_tokens,
            slo_ttft_s=(ask.slo_ttft_ms or self.config.slo_ttft_ms) / 1e3,
            slo_tbt_s=(ask.slo_tbt_ms or self.config.slo_tbt_ms) / 1e3,
        )
        live_prefill = {hb.instance_id for hb in self.registry.alive("prefill", now)}
        live_decode = {hb.instance_id: hb for hb in self.registry.alive("decode", now)}
        prefills = [x for x in self.state.prefill_loads(ask.block_hashes, now) if x.instance_id in live_prefill]
        decodes = [self._with_room(x, live_decode[x.instance_id]) for x in self.state.decode_loads() if x.instance_id in live_decode]
        out = self.scheduler.schedule(req, prefills, decodes, now)
        log.debug("decision", request_id=req.request_id, request=req, prefills=prefills, decodes=decodes, out=out)
        if not isinstance(out, Decision):
            self.counts["rejected"] += 1
            return ScheduleReply(
                request_id=req.request_id, accepted=False, rejection=out.kind, reason=out.reason, retry_after_s=out.retry_after_s
            )
        self.counts["accepted"] += 1
        self.state.assign(req, ask.block_hashes, out, now)
        self.deadlines[req.request_id] = ask.deadline
        return ScheduleReply(
            request_id=req.request_id,
            accepted=True,
            prefill_id=out.prefill.instance_id,
            decode_id=out.decode_id,
            predicted_ttft_ms=out.prefill.ttft_s * 1e3,
            predicted_tbt_ms=out.tbt_s * 1e3,
            pull_from=out.prefill.pull_from,
            pull_blocks=out.prefill.pull_blocks,
        )

    @staticmethod
    def _with_room(load: DecodeLoad, hb: Heartbeat) -> DecodeLoad:
        """A decode engine that reports its KV cache full takes nobody new, whatever
        the books say (they only know what this Conductor sent it)."""
        if hb.kv_usage >= KV_FULL:
            return DecodeLoad(load.instance_id, load.items, capacity=min(load.capacity, len(load.items)))
        return load

    def on_event(self, event: RequestEvent, now: float) -> None:
        if event.kind == "prefill_done":
            self.state.prefill_done(event.request_id, now)
            return
        if event.kind == "decode_refused":
            self.counts["wasted_prefill"] += 1
            log.warning("wasted prefill: decode refused", request_id=event.request_id, decode=event.instance_id)
        self.finish(event.request_id, now)

    def finish(self, request_id: str, now: float) -> None:
        self.deadlines.pop(request_id, None)
        self.state.finished(request_id, now)


def parser() -> argparse.ArgumentParser:
    return service.parser("conductor", instance=False)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    conductor = Conductor(config)
    nc = await bus.connect(config.nats_url, name="conductor")

    async def on_heartbeat(hb: Heartbeat, _msg: Any) -> None:
        conductor.on_heartbeat(hb, time.monotonic())

    async def on_event(event: RequestEvent, _msg: Any) -> None:
        conductor.on_event(event, time.monotonic())

    async def on_schedule(ask: ScheduleRequest, msg: Msg) -> None:
        reply = conductor.schedule(ask, time.monotonic())
        log.info(
            "scheduled" if reply.accepted else "rejected",
            request_id=ask.request_id,
            prefill=reply.prefill_id or None,
            decode=reply.decode_id or None,
            ttft_ms=round(reply.predicted_ttft_ms, 1),
            pull_from=reply.pull_from or None,
            reason=reply.reason or None,
            prompt_len=ask.prompt_len,
        )
        await msg.respond(encode(reply))

    await bus.subscribe(nc, HEARTBEAT, Heartbeat, on_heartbeat)
    await bus.subscribe(nc, REQUEST_EVENTS, RequestEvent, on_event)
    await bus.subscribe(nc, SCHEDULE, ScheduleRequest, on_schedule, queue=CONDUCTOR_QUEUE)
    log.info("conductor ready", policy=config.policy, admission=config.admission, profile=str(profile_path(config)))
    await stop.wait()
    log.info("conductor stopping", **conductor.counts)
    await bus.close(nc)
