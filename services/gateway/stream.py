"""One decode attempt's token stream into the gateway.

NATS hands each chunk to a callback that queues it, so waiting for the next token
costs no task and no timer. What ends a stream other than its chunks (the
request's deadline, a stream gone quiet, an instance that stopped beating) is
watched by one task per stream, waking once per heartbeat interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import bus


class StreamEnded(Exception):
    """Why a stream was given up (the watchdog's verdict): an HTTP status and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TokenStream:
    """The raw chunks published on one stream subject, in arrival order."""

    def __init__(self, instance_id: str, deadline: float, idle_timeout_s: float, check_s: float,
                 check_alive: Callable[[str], None]) -> None:
        self.instance_id = instance_id
        self.deadline = deadline  # wall clock, as the request's
        self.idle_timeout_s = idle_timeout_s
        self.check_s = check_s
        self.check_alive = check_alive  # raises when the instance stopped beating
        self.queue: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self.last = time.monotonic()
        self.sub: Subscription | None = None
        self.watchdog: asyncio.Task[None] | None = None

    async def open(self, nc: Client, subject: str) -> None:
        self.sub = await nc.subscribe(subject, cb=self._arrived)
        self.watchdog = asyncio.create_task(self._watch(), name=f"stream watchdog {subject}")

    async def next(self) -> bytes:
        """The next chunk's bytes; raises what the watchdog found instead."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.sub is not None:
            await self.sub.unsubscribe()

    async def _arrived(self, msg: Msg) -> None:
        self.last = time.monotonic()
        self.queue.put_nowait(msg.data)

    async def _watch(self) -> None:
        while True:
            left = bus.remaining(self.deadline)
            await asyncio.sleep(max(0.0, min(left, self.check_s)))
            try:
                self._check()
            except BaseException as e:
                self.queue.put_nowait(e)
                return

    def _check(self) -> None:
        """Raise why the stream should be given up now, if it should."""
        if bus.remaining(self.deadline) <= 0:
            raise StreamEnded(504, "deadline exceeded while decoding")
        quiet_s = time.monotonic() - self.last
        if quiet_s > self.idle_timeout_s:
            raise StreamEnded(504, f"no token from {self.instance_id} for {self.idle_timeout_s:.0f} s")
        if quiet_s >= self.check_s:  # a stream still delivering is alive, beats or not
            self.check_alive(self.instance_id)
