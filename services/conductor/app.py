"""Wiring of the Conductor: heartbeats build the live view, schedule requests get
an answer from the policy."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import structlog
from nats.aio.msg import Msg

from services.conductor.policy import Decision, make_policy
from shared import bus, service
from shared.config import ClusterConfig
from shared.liveness import Registry
from shared.messages import CONDUCTOR_QUEUE, HEARTBEAT, SCHEDULE, Heartbeat, ScheduleReply, ScheduleRequest, encode

log = structlog.get_logger(__name__)


class Conductor:
    def __init__(self, config: ClusterConfig) -> None:
        self.registry = Registry(timeout_s=config.liveness_timeout_s)
        self.policy = make_policy(config.policy)

    async def on_heartbeat(self, hb: Heartbeat, _msg: Any) -> None:
        now = time.monotonic()
        if self.registry.observe(hb, now):
            log.info("instance up", instance_id=hb.instance_id, role=hb.role, node=hb.node)
        for gone in self.registry.expire(now):
            log.warning("instance lost", instance_id=gone)

    def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        now = time.monotonic()
        choice = self.policy.choose(self.registry.alive("prefill", now), self.registry.alive("decode", now))
        if isinstance(choice, Decision):
            return ScheduleReply(
                request_id=req.request_id, accepted=True, prefill_id=choice.prefill_id, decode_id=choice.decode_id
            )
        return ScheduleReply(
            request_id=req.request_id,
            accepted=False,
            rejection=choice.kind,
            reason=choice.reason,
            retry_after_s=choice.retry_after_s,
        )

    async def on_schedule(self, req: ScheduleRequest, msg: Msg) -> None:
        reply = self.schedule(req)
        log.info(
            "scheduled" if reply.accepted else "rejected",
            request_id=req.request_id,
            prefill=reply.prefill_id or None,
            decode=reply.decode_id or None,
            reason=reply.reason or None,
            prompt_len=req.prompt_len,
        )
        await msg.respond(encode(reply))


def parser() -> argparse.ArgumentParser:
    return service.parser("conductor", instance=False)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    conductor = Conductor(config)
    nc = await bus.connect(config.nats_url, name="conductor")
    await bus.subscribe(nc, HEARTBEAT, Heartbeat, conductor.on_heartbeat)
    await bus.subscribe(nc, SCHEDULE, ScheduleRequest, conductor.on_schedule, queue=CONDUCTOR_QUEUE)
    log.info("conductor ready", policy=config.policy)
    await stop.wait()
    await bus.close(nc)
