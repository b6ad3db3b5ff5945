"""Shedding at the gateway: at most `max_running` requests are served at once and at
most `max_waiting` more wait for a slot, each for at most `queue_timeout_s`; every
other request is turned away at once with a 429 and Retry-After, so overload costs
the client a retry, never the gateway its memory or its event loop.

A slot is taken before a request is tokenized (the gateway's own expensive step) and
held until its response is done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.gateway.errors import ApiError
from shared.config import ClusterConfig


@dataclass
class Shed(Exception):
    """The gateway turned a request away; `reason` labels the metric."""

    reason: str  # "queue_full" | "queue_timeout"
    message: str
    retry_after_s: int = 1

    def api_error(self) -> ApiError:
        return ApiError(429, f"gateway overloaded: {self.message}", "rate_limit_error", code="overloaded",
                        headers={"Retry-After": str(self.retry_after_s)})


class Admission:
    def __init__(self, max_running: int, max_waiting: int, queue_timeout_s: float) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self.waiting = 0
        self._free = asyncio.Semaphore(max_running)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> Admission:
        return cls(config.gateway_max_running, config.gateway_max_waiting, config.gateway_queue_timeout_s)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a serving slot for the block; raises Shed when none comes in time."""
        await self._acquire()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._free.release()

    async def _acquire(self) -> None:
        if not self._free.locked():
            await self._free.acquire()  # a free slot: never suspends
            return
        if self.waiting >= self.max_waiting:
            raise Shed("queue_full", f"{self.running} requests running and {self.waiting} waiting")
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await self._free.acquire()
        except TimeoutError:
            raise Shed("queue_timeout", f"no serving slot within {self.queue_timeout_s:g} s",
                       retry_after_s=max(1, round(self.queue_timeout_s / 2))) from None
        finally:
            self.waiting -= 1
