"""The gateway's HTTP server, bounded in every wait a client controls.

- headers: a request's headers must arrive within `header_timeout_s` of the
  connection opening (or of their first byte on a kept-alive connection); else a 408
  and the connection closes (a slow-loris holds nothing for long);
- body: read within `body_timeout_s` (services/gateway/edge.py read_body; a 408) and
  at most `max_body_bytes` (aiohttp's client_max_size; a 413);
- idle keep-alive connections close after `keepalive_timeout_s` (aiohttp's own);
- writes: a client that stops reading gets `write_timeout_s` to take the next bytes
  of a response; then its request is cancelled upstream and its connection aborted;
- connections: beyond `max_connections` open at once, a new one is answered 503
  (with Retry-After) and closed before any request is read.

Every refusal is an OpenAI-style JSON body, like every other error, and is counted
on /metrics. `LagMonitor` samples the event loop's lag into /metrics too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import structlog
from aiohttp import web

from services.gateway import edge
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from shared.config import ClusterConfig

log = structlog.get_logger(__name__)
T = TypeVar("T")
# How long a body left unread after an early answer (a 413, a 408) is still drained,
# so that the client sees that answer rather than a reset; aiohttp's default is 10 s.
LINGERING_S = 2.0


@dataclass(frozen=True)
class HttpLimits:
    """The config's gateway_* HTTP settings (declared, with their defaults, there)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    write_timeout_s: float
    max_body_bytes: int

    @classmethod
    def from_config(cls, c: ClusterConfig) -> HttpLimits:
        return cls(c.gateway_max_connections, c.gateway_header_timeout_s, c.gateway_body_timeout_s,
                   c.gateway_keepalive_timeout_s, c.gateway_write_timeout_s, c.gateway_max_body_bytes)


@dataclass(frozen=True)
class Guard:
    """What every connection of one server checks against, and counts into."""

    limits: HttpLimits
    metrics: GatewayMetrics


class WriteTimeout(Exception):
    """A client took none of a response's next bytes within the write timeout;
    `response` is the one that was being written (the handler's to return)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"client took no bytes for {timeout_s:g} s")
        self.response: web.StreamResponse | None = None


async def bounded(write: Awaitable[T], timeout_s: float) -> T:
    """A write to a client (write, prepare, write_eof), bounded: a client that stops
    reading blocks it only so long."""
    try:
        async with asyncio.timeout(timeout_s):
            return await write
    except TimeoutError as e:
        raise WriteTimeout(timeout_s) from e


async def bounded_write(request: web.Request, response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """A streamed chunk, bounded as `bounded` bounds a write. One that cannot block goes
    without the timer: aiohttp's write waits only while writing is paused, and the
    transport pauses it only when its buffer goes over the high-water mark."""
    if writable(request, len(data)):
        await response.write(data)
    else:
        await bounded(response.write(data), timeout_s)


def writable(request: web.Request, size: int = 0) -> bool:
    """Whether `size` more bytes to the client go into its transport's buffer
    without waiting (the buffer stays under its high-water mark)."""
    transport = request.transport
    return transport is not None and not transport.is_closing() and not request.protocol.writing_paused \
        and transport.get_write_buffer_size() + size <= transport.get_write_buffer_limits()[1]


def write_now(response: web.StreamResponse, data: bytes) -> None:
    """A streamed chunk written from a callback, where nothing may wait: the caller
    checked `writable`, so aiohttp's write runs to its end without waiting."""
    write = response.write(data)
    try:
        write.send(None)
    except StopIteration:
        return
    write.close()  # it would have waited: the caller's check and aiohttp's disagree
    raise RuntimeError("a write to the client would have waited where it could not")


def abort(request: web.Request) -> None:
    """Drop a connection now, unsent bytes and all (close() would wait to send them)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


def raw_response(error: ApiError) -> bytes:
    """A whole HTTP response for an answer given outside any handler, then closed."""
    body = error.json()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in error.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedHandler(edge.JsonErrorHandler):
    """One connection: aiohttp's handler (JSON errors) with the header timeout, the
    connection cap and a bounded final write."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager.guard
        self._header_timer: tuple[int, asyncio.TimerHandle] | None = None  # (request count when armed, timer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if manager is not None and len(manager.connections) >= self._guard.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_header_timer()  # the first request's headers are due from the connection's start

    def _refuse(self, transport: Any) -> None:
        self._manager = None  # never registered: connection_lost has nothing to undo
        self._force_close = True
        self._guard.metrics.refused.inc()
        error = ApiError(503, f"too many connections (at most {self._guard.limits.max_connections})", "server_error",
                         code="too_many_connections", headers={"Retry-After": "1"})
        transport.write(raw_response(error))
        transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._idle():
            self._arm_header_timer()

    def _idle(self) -> bool:
        """Waiting for a request's headers: not handling one, not draining a body."""
        return self._waiter is not None and not self._waiter.done() and not self._force_close

    def _arm_header_timer(self) -> None:
        timer = self._header_timer
        if timer is not None and timer[0] == self._request_count:
            return  # already timing these headers
        if timer is not None:
            timer[1].cancel()
        handle = self._loop.call_later(self._guard.limits.header_timeout_s, self._headers_late, self._request_count)
        self._header_timer = (self._request_count, handle)

    def _headers_late(self, count: int) -> None:
        self._header_timer = None
        # No request parsed since the timer started, and still waiting for one.
        if self._request_count != count or not self._idle() or self.transport is None:
            return
        self._guard.metrics.http_timeouts.labels("header").inc()
        log.info("request headers too slow: connection closed", timeout_s=self._guard.limits.header_timeout_s)
        error = ApiError(408, f"request headers not received within {self._guard.limits.header_timeout_s:g} s",
                         code="header_timeout")
        self.transport.write(raw_response(error))
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer[1].cancel()
            self._header_timer = None
        super().connection_lost(exc)

    async def finish_response(self, request: Any, resp: web.StreamResponse, start_time: float | None) -> Any:
        # Where a non-streamed response (or an error) is written: bounded like a stream's writes.
        try:
            async with asyncio.timeout(self._guard.limits.write_timeout_s):
                return await super().finish_response(request, resp, start_time)
        except TimeoutError:
            self._guard.metrics.http_timeouts.labels("write").inc()
            log.info("client stopped reading a response: connection aborted")
            if self.transport is not None:
                self.transport.abort()
            return resp, True  # as aiohttp's own "client went away"


class GuardedServer(edge.JsonErrorServer):
    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        guard.metrics.connections.set_function(lambda: len(self._connections))

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """The app's runner: guarded connections; a client that disconnects cancels its
    handler (which cancels its request on every instance)."""

    def __init__(self, app: web.Application, guard: Guard) -> None:
        super().__init__(app, handler_cancellation=True, access_log=None,
                         keepalive_timeout=guard.limits.keepalive_timeout_s, lingering_time=LINGERING_S)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop, guard=self.guard,
                             **plain._kwargs)


LAG_INTERVAL_S = 0.05  # how often the lag monitor wakes


class LagMonitor:
    """Samples the event loop's lag (how late a short sleep wakes) into a histogram:
    any step that holds the loop shows here, and in every request's latency."""

    def __init__(self, metrics: GatewayMetrics, interval_s: float = LAG_INTERVAL_S,
                 on_tick: Callable[[float], Any] | None = None) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.on_tick = on_tick  # called with the monotonic clock at each wake
        self.max_lag_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            if self.on_tick is not None:
                self.on_tick(time.monotonic())
            lag = max(0.0, time.perf_counter() - start - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, lag)
            self.metrics.loop_lag.observe(lag)
            if lag > 0.1:
                log.warning("event loop stalled", lag_ms=round(lag * 1e3, 1))
