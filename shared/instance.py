"""What every instance (prefill, decode, messenger) does besides its own work:
announce itself with heartbeats, own its in-flight requests, and abort one on a
Cancel."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client

from shared import bus
from shared.calibration import Calibration, quantile_z
from shared.config import ClusterConfig
from shared.messages import CANCEL, HEARTBEAT, Cancel, Heartbeat, Role
from shared.outbox import Outbox
from shared.token_channel import Channels

log = structlog.get_logger(__name__)


@dataclass
class EngineLoad:
    """The engine scheduler's latest view of itself, for heartbeats (an engine's
    stat logger keeps it current; instances without an engine leave it at zero)."""

    num_waiting: int = 0
    kv_usage: float = 0.0
    # Its steps' observed over predicted time, fed by the role that can judge them
    # (decode: the gap between a request's tokens against the predicted step).
    calibration: Calibration = field(default_factory=Calibration)


class Instance:
    """Identity, load counters and the task of every request this instance runs."""

    def __init__(
        self, role: Role, instance_id: str, node: str, config: ClusterConfig, nc: Client, load: EngineLoad | None = None,
        stages: int = 1, reconnected: bus.Reconnected | None = None,
    ) -> None:
        self.reconnected = reconnected or bus.Reconnected()  # told by its client's events (bus.connect)
        self.role = role
        self.stages = stages  # its engine's pipeline stages (a CPP prefill group: more than 1)
        self.load = load or EngineLoad()
        self.instance_id = instance_id
        self.node = node
        self.config = config
        self.nc = nc
        self.requests: dict[str, asyncio.Task[Any]] = {}
        self.served_total = 0
        self.aborted_total = 0
        self.endpoint = ""  # messengers: their transfer endpoint, announced in heartbeats
        self.outbox = Outbox(nc)  # its requests' tokens, to the gateways
        self.channels = Channels(instance_id)  # the gateways' token channels (decode's)
        self._seq = 0
        self.draining = False  # stopping: refuses new requests, hands its last ones on (drain)
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await bus.subscribe(self.nc, CANCEL, Cancel, self._on_cancel)
        await self.beat()  # announce at once: the launcher waits for this
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="heartbeat")

    def run(self, request_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run one request's work as a task that a Cancel can abort."""
        if request_id in self.requests:
            work.close()
            raise ValueError(f"request {request_id} is already running here")
        task = asyncio.create_task(work, name=request_id)
        self.requests[request_id] = task
        task.add_done_callback(lambda t: self._finished(request_id, t))

    def _finished(self, request_id: str, task: asyncio.Task[Any]) -> None:
        self.requests.pop(request_id, None)
        if task.cancelled():
            self.aborted_total += 1
        else:
            self.served_total += 1
            if task.exception() is not None:
                log.error("request failed", request_id=request_id, exc_info=task.exception())

    async def _on_cancel(self, cancel: Cancel, _msg: Any) -> None:
        task = self.requests.get(cancel.request_id)
        if task is not None:
            log.info("request aborted", request_id=cancel.request_id, reason=cancel.reason)
            task.cancel()

    def heartbeat(self) -> Heartbeat:
        self._seq += 1
        return Heartbeat(
            instance_id=self.instance_id,
            role=self.role,
            node=self.node,
            pid=os.getpid(),
            seq=self._seq,
            sent_at=time.time(),
            # Requests this instance holds (exact, and 0 the moment the last ends);
            # the engine's stats come in steps and stop when it idles.
            num_running=len(self.requests),
            num_waiting=self.load.num_waiting,
            kv_usage=self.load.kv_usage,
            served_total=self.served_total,
            aborted_total=self.aborted_total,
            endpoint=self.endpoint,
            slowdown=self.slowdown(),
            stages=self.stages,
            draining=self.draining,
            reconnected_at=self.reconnected.at,
        )

    def slowdown(self) -> float:
        """What this instance's predicted times are multiplied by now (1: not calibrated):
        the pace its role measured, at the quantile the cluster aims its SLOs at."""
        if not self.config.calibrate_time_model:
            return 1.0
        return self.load.calibration.pace(time.monotonic(), quantile_z(self.config.slo_attainment))

    def slowdown_evidence_s(self) -> float:
        """Predicted seconds of recent work `slowdown` rests on (0: it is 1 for want of any)."""
        return self.load.calibration.evidence_s(time.monotonic()) if self.config.calibrate_time_model else 0.0

    async def beat(self) -> None:
        await bus.publish(self.nc, HEARTBEAT, self.heartbeat())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await self.beat()
            except Exception as e:  # a NATS hiccup must not stop the heartbeat for good
                log.warning("heartbeat failed", error=str(e))

    async def drain(self, timeout_s: float) -> int:
        """Stop taking requests (the next heartbeat, sent now, says so: nothing more is
        placed here) and let those running finish, for up to `timeout_s`; returns how
        many are still running. close() then ends them, and each role's handler hands
        its own on (`draining` tells it to)."""
        self.draining = True
        try:
            await self.beat()
        except Exception as e:  # the Conductor's liveness timeout says the same, later
            log.warning("draining heartbeat failed", error=str(e))
        running = list(self.requests.values())
        log.info("draining", requests=len(running), timeout_s=timeout_s)
        if running and timeout_s > 0:
            await asyncio.wait(running, timeout=timeout_s)
        return len(self.requests)

    async def close(self) -> None:
        tasks = list(self.requests.values())
        if self._heartbeat is not None:
            tasks.append(self._heartbeat)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.outbox.flush()  # the last steps' chunks, before the connection drains
        await self.channels.close()
