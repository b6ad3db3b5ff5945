"""Decode attempts' token streams into the gateway.

The gateway listens on one stream subject, its inbox: decode instances send each
engine step's chunks for this gateway there as one TokenBatch, and the inbox hands
each chunk to its attempt's stream (by attempt id; a chunk of an attempt no longer
open here is dropped). A stream queues its chunks, so waiting for the next token
costs no task and no timer. What ends a stream other than its chunks (the request's
deadline, a stream gone quiet, an instance that stopped beating) is watched by one
task per stream, waking once per heartbeat interval.

Handing a token to its request costs one wake of the request's task: the queue is
a deque and at most one waiting future, not an asyncio.Queue with its loop checks
and waiter lists. An ordinary token costs no wake at all where the stream has a
sink: while the request's task waits for its next chunk (everything before it is
done), the sink takes the chunk on the inbox's callback, all the way to the
client's socket (services/gateway/app.py), or leaves it to the queue."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import TypeAlias

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import Counter

from shared import bus
from shared.liveness import woke_late
from shared.messages import MessageError, TokenBatch, TokenChunk, decode, stream_subject
from shared.token_channel import ChannelServer

log = structlog.get_logger(__name__)
Sink: TypeAlias = Callable[[TokenChunk], bool]  # takes a chunk whole (True), or leaves it to the queue


class StreamEnded(Exception):
    """Why a stream was given up (the watchdog's verdict): an HTTP status and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TokenStream:
    """One attempt's chunks, in arrival order."""

    def __init__(self, instance_id: str, deadline: float, idle_timeout_s: float, check_s: float,
                 check_alive: Callable[[str], None]) -> None:
        self.instance_id = instance_id
        self.deadline = deadline  # wall clock, as the request's
        self.idle_timeout_s = idle_timeout_s
        self.check_s = check_s
        self.check_alive = check_alive  # raises when the instance stopped beating
        self.queue: deque[TokenChunk | BaseException] = deque()
        self.waiter: asyncio.Future[None] | None = None  # the request's task, while the queue is empty
        self.last = time.monotonic()
        self.watchdog: asyncio.Task[None] | None = None
        self.inbox: Inbox | None = None
        self.attempt_id = ""
        self.sink: Sink | None = None

    async def open(self, inbox: Inbox, nc: Client | bus.Link, attempt_id: str) -> None:
        """Take the chunks of `attempt_id` from now on (the inbox listening on `nc`)."""
        await inbox.listen(nc)
        self.inbox, self.attempt_id = inbox, attempt_id
        inbox.streams[attempt_id] = self
        self.watchdog = asyncio.create_task(self._watch(), name=f"stream watchdog {attempt_id}")

    async def next(self) -> TokenChunk:
        """The next chunk; raises what the watchdog found instead."""
        while not self.queue:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.queue.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.inbox is not None:
            self.inbox.streams.pop(self.attempt_id, None)

    def arrived(self, chunk: TokenChunk) -> None:
        self.last = time.monotonic()
        if not self._sunk(chunk):
            self._put(chunk)

    def _sunk(self, chunk: TokenChunk) -> bool:
        """Whether the sink took the chunk. Only while the request's task waits here
        with nothing queued: every chunk before this one has then been handled."""
        if self.sink is None or self.queue or self.waiter is None or self.waiter.done():
            return False
        try:
            return self.sink(chunk)
        except Exception as e:  # its own request fails (in its task), not the inbox's other streams
            self.sink = None
            self._put(e)
            return True

    def _put(self, item: TokenChunk | BaseException) -> None:
        self.queue.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _watch(self) -> None:
        while True:
            nap = max(0.0, min(bus.remaining(self.deadline), self.check_s))
            since = time.monotonic()
            await asyncio.sleep(nap)
            if woke_late(since, nap, self.check_s):
                continue  # the tokens and heartbeats that came meanwhile are still unread
            try:
                self._check()
            except BaseException as e:
                self._put(e)
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


class Inbox:
    """The gateway's stream subject and token channel, and the streams open on them by
    attempt id. Batches come either way: over the channel (shared/token_channel.py)
    from a decode instance connected to it, over NATS otherwise."""

    def __init__(self, name: str = "") -> None:
        self.subject = stream_subject(name or secrets.token_hex(8))
        self.channel = ChannelServer(self._channelled)  # decode instances' direct connections, once started
        self.streams: dict[str, TokenStream] = {}
        self.client: Client | None = None  # the NATS client listening, once one is
        self.dropped = Counter("yuebing_gateway_late_chunks", "Token chunks for no attempt open here (late ones of "
                               "attempts given up), dropped", registry=None)
        self.batches = Counter("yuebing_gateway_token_batches", "Token batches taken from decode instances, by the "
                               "way they came: channel (a direct connection) or nats", ["way"], registry=None)
        self._by_nats, self._by_channel = self.batches.labels("nats"), self.batches.labels("channel")

    async def listen(self, nc: Client | bus.Link) -> None:
        """Subscribe on `nc`'s current client, unless already: a Link that replaced its
        client (services/gateway/app.py) gets the subscription again on the new one.
        Subscribing before asking for a decode means no chunk comes before we listen."""
        client = nc.client if isinstance(nc, bus.Link) else nc
        if client is not self.client:
            await client.subscribe(self.subject, cb=self._arrived)
            self.client = client

    async def _arrived(self, msg: Msg) -> None:
        self._by_nats.inc()
        self.deliver(msg.data)

    def _channelled(self, data: bytes) -> None:
        self._by_channel.inc()
        self.deliver(data)

    def deliver(self, data: bytes) -> None:
        """One TokenBatch's bytes, from NATS or a token channel: each chunk to its stream."""
        try:
            batch = decode(data, TokenBatch)
        except MessageError as e:  # no attempt to blame: its streams end by the watchdog
            log.warning("bad token batch", error=str(e))
            return
        for chunk in batch.chunks:
            stream = self.streams.get(chunk.request_id)
            if stream is None:
                self.dropped.inc()
            else:
                stream.arrived(chunk)
