"""NATS helpers: connect, and subscribe with schema-checked messages.

A message that fails its schema is logged and dropped (and, for a request, answered
with nothing so the requester times out cleanly); it never reaches a handler or
crashes a service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.identity import NatsCredentials, inbox_prefix
from shared.messages import M, Message, MessageError, decode, encode

log = structlog.get_logger(__name__)


async def connect(url: str, name: str, credentials: NatsCredentials | None = None) -> Client:
    """Connect as `credentials`' identity (none: a server without authentication),
    with replies on that identity's own inbox, the only one it may read."""

    async def on_error(e: Exception) -> None:
        log.warning("nats error", error=str(e))

    auth: dict[str, Any] = {}
    if credentials is not None:
        auth = {"user": credentials.user, "password": credentials.password,
                "inbox_prefix": inbox_prefix(credentials.user), "tls": credentials.tls()}
    return await nats.connect(
        url,
        name=name,
        error_cb=on_error,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        **auth,
    )


async def subscribe(
    nc: Client,
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
            await handler(message, msg)
        except Exception:
            log.exception("handler failed", subject=msg.subject)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)


async def request(nc: Client, subject: str, message: Message, reply: type[M], timeout: float) -> M:
    """Request/reply with a schema-checked answer. Raises TimeoutError or MessageError."""
    if timeout <= 0:
        raise TimeoutError(f"no time left to ask {subject}")
    try:
        msg = await nc.request(subject, encode(message), timeout=timeout)
    except nats.errors.NoRespondersError as e:
        raise TimeoutError(f"nobody serves {subject}") from e
    except nats.errors.TimeoutError as e:
        raise TimeoutError(f"{subject} did not answer within {timeout:.1f}s") from e
    return decode(msg.data, reply)


async def publish(nc: Client, subject: str, message: Message) -> None:
    await nc.publish(subject, encode(message))


async def close(nc: Client, timeout: float = 5.0) -> None:
    """Drain (finish in-flight handlers, flush publishes), then close; never raises,
    since it runs on the way out, when the server may already be gone."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception as e:
        log.info("nats drain incomplete", error=str(e) or type(e).__name__)
        await nc.close()


def remaining(deadline: float) -> float:
    return deadline - time.time()
