"""Shedding at the gateway: at most `max_running` requests are served at once and at
most `max_waiting` more wait for a slot, each for at most `queue_timeout_s`; every
other request is turned away at once with a 429 and Retry-After, so overload costs
the client a retry, never the gateway its memory or its event loop.

A slot is taken before a request is tokenized (the gateway's own expensive step) and
held until its response is done."""

from __future__ import annotations

import asyncio
import heapq
import itertools
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
    """Serving slots, and a queue for them ordered as vLLM's priority scheduling orders
    its own: lower `priority` first, then arrival."""

    def __init__(self, max_running: int, max_waiting: int, queue_timeout_s: float) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap: (priority, arrival, its handover)
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> Admission:
        return cls(config.gateway_max_running, config.gateway_max_waiting, config.gateway_queue_timeout_s)

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold a serving slot for the block; raises Shed when none comes in time."""
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self.running < self.max_running and not self._queue:
            self.running += 1  # a free slot: never suspends
            return
        if self.waiting >= self.max_waiting:
            raise Shed("queue_full", f"{self.running} requests running and {self.waiting} waiting")
        handover: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), handover)
        heapq.heappush(self._queue, entry)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await asyncio.shield(handover)
        except TimeoutError:
            if handover.done():  # handed its slot as its time ran out: it is served
                return
            self._drop(entry)
            raise Shed("queue_timeout", f"no serving slot within {self.queue_timeout_s:g} s",
                       retry_after_s=max(1, round(self.queue_timeout_s / 2))) from None
        except BaseException:  # cancelled while waiting: its place, or the slot it was handed, goes on
            if handover.done():
                self._release()
            else:
                self._drop(entry)
            raise

    def _release(self) -> None:
        """A slot freed: handed to the first waiter in order, else back to the free ones."""
        if self._queue:
            _, _, handover = heapq.heappop(self._queue)
            handover.set_result(None)  # `running` unchanged: the slot goes on, to it
            return
        self.running -= 1

    def _drop(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        self._queue.remove(entry)
        heapq.heapify(self._queue)
