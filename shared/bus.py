"""NATS helpers: connect, and subscribe with schema-checked messages; `Link`, a
connection that outlives its clients.

A message that fails its schema is logged and dropped (and, for a request, answered
with nothing so the requester times out cleanly); it never reaches a handler or
crashes a service.

Every client is bounded: while the server is away it buffers at most PENDING_BYTES
(a publish beyond that raises OutboundBufferLimitError at once), a forced flush waits
at most FLUSH_TIMEOUT_S, and each disconnect, reconnect and close is logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import tracing
from shared.identity import NatsCredentials, inbox_prefix
from shared.messages import M, Message, MessageError, decode, encode

log = structlog.get_logger(__name__)

# What one client may hold while its server is away: nats-py's own default, named
# here so that it stays bounded on purpose.
PENDING_BYTES = 2 << 20
# nats-py waits for a forced flush (a full pending buffer) forever unless told.
FLUSH_TIMEOUT_S = 2.0
# Every error a NATS call raises: closed, reconnecting, buffer full, no responders, ...
BusError = nats.errors.Error
WATCHDOG_S = 1.0  # how often a Link looks at its client, callbacks or not
OnEvent = Callable[[str], None]  # "disconnected" | "reconnected" | "closed" | "replaced"


class Reconnected:
    """When a client last reconnected (to its server again, or to another of a cluster;
    a Link's: or was replaced), wall clock, 0 if never: a message in flight then may
    have been lost. Given to connect() or a Link as (part of) its `on_event`."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self, kind: str) -> None:
        if kind in ("reconnected", "replaced"):
            self.at = time.time()


def servers(url: str) -> list[str]:
    """A `nats_url`'s servers: one URL, or a NATS cluster's, comma-separated. A client
    given them all reaches the cluster while any one answers (and learns of more
    from the servers themselves)."""
    found = [u.strip() for u in url.split(",") if u.strip()]
    if not found:
        raise ValueError(f"no NATS server in {url!r}")
    return found


async def connect(
    url: str, name: str, credentials: NatsCredentials | None = None, *,
    on_event: OnEvent | None = None, closed_cb: Callable[[], Awaitable[None]] | None = None, no_echo: bool = False,
) -> Client:
    """Connect as `credentials`' identity (none: a server without authentication),
    with replies on that identity's own inbox, the only one it may read. The client
    reconnects by itself after a disconnect; it closes for good only on a server's
    protocol error (or close()), when `closed_cb` runs. `no_echo`: the server does not
    hand this connection what it published itself, on a subject it also listens to."""
    event = on_event or (lambda _kind: None)

    async def on_error(e: Exception) -> None:
        log.warning("nats error", name=name, error=str(e) or type(e).__name__)

    async def on_disconnected() -> None:
        event("disconnected")
        log.warning("nats disconnected", name=name)

    async def on_reconnected() -> None:
        event("reconnected")
        log.info("nats reconnected", name=name)

    async def on_closed() -> None:
        event("closed")
        log.info("nats connection closed", name=name)
        if closed_cb is not None:
            await closed_cb()

    auth: dict[str, Any] = {}
    if credentials is not None:
        auth = {"user": credentials.user, "password": credentials.secret(),
                "inbox_prefix": inbox_prefix(credentials.user), "tls": credentials.tls()}
    return await nats.connect(
        servers(url), name=name, error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
        closed_cb=on_closed, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
        pending_size=PENDING_BYTES, flush_timeout=FLUSH_TIMEOUT_S, no_echo=no_echo, **auth,
    )


class Link:
    """A NATS connection that outlives its clients: it holds the current client and,
    when that one closes for good (a server's protocol error closes a client instead
    of reconnecting it), makes a new one, runs `on_connect` on it (subscriptions) and
    logs it. Callers use it like a client (request, publish, subscribe,
    is_connected); while no client is open, those raise ConnectionClosedError at once,
    never wait. Services that need none of this may keep a plain `connect` client."""

    def __init__(
        self, url: str, name: str, credentials: NatsCredentials | None = None, *,
        on_connect: Callable[[Client], Awaitable[Any]] | None = None, on_event: OnEvent | None = None,
        retry_s: float = 0.5,
    ) -> None:
        self.url, self.name, self.credentials = url, name, credentials
        self.on_connect = on_connect
        self.reconnected = Reconnected()
        told = on_event or (lambda _kind: None)

        def event(kind: str) -> None:
            self.reconnected(kind)
            told(kind)

        self.on_event: OnEvent = event
        self.retry_s = retry_s
        self.replacements = 0
        self._client: Client | None = None
        self._replacing: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> Link:
        self._client = await self._connect()
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        """Catches a close nats-py did not call back about, even with no traffic."""
        while not self._stopping:
            await asyncio.sleep(WATCHDOG_S)
            self._remake()

    @property
    def client(self) -> Client:
        nc = self._client
        if nc is None or nc.is_closed:
            # nats-py may close a client without its closed callback (a close that
            # fails to flush on a dead socket): asking is reason enough to remake it.
            self._remake()
            raise nats.errors.ConnectionClosedError  # a new client is on its way
        return nc

    @property
    def is_connected(self) -> bool:
        return self._client is not None and self._client.is_connected

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5,
                      headers: dict[str, Any] | None = None) -> Msg:
        return await self.client.request(subject, payload, timeout=timeout, headers=headers)

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        await self.client.publish(subject, payload, reply=reply, headers=headers)

    async def subscribe(self, subject: str, queue: str = "", cb: Any = None) -> Subscription:
        return await self.client.subscribe(subject, queue=queue, cb=cb)

    async def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        for task in (self._replacing, self._watchdog):
            if task is not None:
                task.cancel()
        if self._client is not None and not self._client.is_closed:
            await close(self._client, timeout)

    async def _connect(self) -> Client:
        nc = await connect(self.url, self.name, self.credentials, on_event=self.on_event, closed_cb=self._on_closed)
        try:
            if self.on_connect is not None:
                await self.on_connect(nc)
        except BaseException:
            await nc.close()
            raise
        return nc

    async def _on_closed(self) -> None:
        self._remake()

    def _remake(self) -> None:
        # Only the current client's close matters; ours (close()) is no loss.
        if self._stopping or self._client is None or not self._client.is_closed:
            return
        if self._replacing is None or self._replacing.done():
            log.warning("nats client closed for good: making a new one", name=self.name)
            self._replacing = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        while not self._stopping:
            try:
                nc = await self._connect()
            except (OSError, TimeoutError, BusError) as e:
                log.warning("nats client not made yet", name=self.name, error=str(e) or type(e).__name__)
                await asyncio.sleep(self.retry_s)
                continue
            self._client = nc
            self.replacements += 1
            self.on_event("replaced")
            log.info("nats client replaced", name=self.name, replacements=self.replacements)
            return


async def subscribe(
    nc: Client | Link,
    subject: str,
    kind: type[M],
    handler: Callable[[M, Msg], Awaitable[None]],
    queue: str = "",
) -> Subscription:
    """Subscribe `handler(message, raw)`; runs one message at a time, so handlers
    that take long must hand the work to a task of their own."""

    async def on_msg(msg: Msg) -> None:
        try:
            message = decode(msg.data, kind)
        except MessageError as e:
            log.warning("dropped malformed message", subject=msg.subject, error=str(e))
            return
        try:
            with tracing.continued(msg.headers):  # a traced request's context, for the handler's spans
                await handler(message, msg)
        except Exception:
            log.exception("handler failed", subject=msg.subject)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)


class NoResponders(TimeoutError):
    """Nobody subscribes the subject right now (a service restarting, say)."""


async def request(nc: Client | Link, subject: str, message: Message, reply: type[M], timeout: float) -> M:
    """Request/reply with a schema-checked answer, the current trace's context in its
    headers (shared/tracing.py). Raises TimeoutError or MessageError."""
    if timeout <= 0:
        raise TimeoutError(f"no time left to ask {subject}")
    try:
        msg = await nc.request(subject, encode(message), timeout=timeout, headers=tracing.headers())
    except nats.errors.NoRespondersError as e:
        raise NoResponders(f"nobody serves {subject}") from e
    except nats.errors.TimeoutError as e:
        raise TimeoutError(f"{subject} did not answer within {timeout:.1f}s") from e
    return decode(msg.data, reply)


async def publish(nc: Client | Link, subject: str, message: Message) -> None:
    # No trace context: publishes are updates, heartbeats and tokens, not work of their own.
    await nc.publish(subject, encode(message))


async def close(nc: Client, timeout: float = 5.0) -> None:
    """Drain (finish in-flight handlers, flush publishes), then close; never raises,
    since it runs on the way out, when the server may already be gone."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception as e:
        log.info("nats drain incomplete", error=str(e) or type(e).__name__)
        try:
            await nc.close()
        except Exception as e:  # it flushes what it holds to a socket that may be gone
            log.info("nats close incomplete", error=str(e) or type(e).__name__)


def remaining(deadline: float) -> float:
    return deadline - time.time()
