"""The engine side of the node messenger: a synchronous client for vLLM's processes
(scheduler and worker), a follower that keeps an in-memory set of the pool's
ready blocks from the messenger's events, and a watch that says hello again to a
messenger that restarted (its ticks name no pool: nobody has carved its new one).

vLLM asks "which blocks are here?" on every scheduling step of a waiting request
(hundreds of times a second), so the answer must come from memory, never a round
trip. Every round trip that remains is bounded by a timeout: a dead messenger makes
the engine compute more, never hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog
import zmq

from shared.kv.wire import (
    FAILED_MEMORY_S,
    BlockEvent,
    Control,
    Note,
    Reply,
    Snapshot,
    control_encoder,
    control_endpoint,
    event_decoder,
    events_endpoint,
    reply_decoder,
    written_endpoint,
)

log = structlog.get_logger(__name__)


class MessengerClient:
    """Request/reply and fire-and-forget calls to the node's messenger."""

    def __init__(self, kv_dir: str, node: str, timeout_s: float = 1.0) -> None:
        self.node = node
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._control_addr = control_endpoint(kv_dir, node)
        self._req: zmq.Socket | None = None
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 10_000)
        self._push.connect(written_endpoint(kv_dir, node))
        self._lock = threading.Lock()  # a REQ socket serves one caller at a time

    def call(self, message: Control) -> Reply | None:
        """Send and wait for the reply; None if the messenger does not answer in time."""
        with self._lock:
            sock = self._socket()
            try:
                sock.send(control_encoder.encode(message), zmq.NOBLOCK)
                if sock.poll(self.timeout_ms, zmq.POLLIN):
                    return reply_decoder.decode(sock.recv())
            except zmq.ZMQError as e:
                log.warning("messenger call failed", node=self.node, error=str(e))
            # A REQ socket that missed its reply is stuck; start over with a new one.
            self._close_req()
            log.warning("messenger did not answer", node=self.node, call=type(message).__name__)
            return None

    def note(self, message: Note) -> bool:
        """Fire and forget: a dead messenger costs nothing here."""
        try:
            self._push.send(control_encoder.encode(message), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        with self._lock:
            self._close_req()
        self._push.close(linger=100)  # a last note (Bye) gets a moment to leave; a dead messenger costs 0.1 s

    def _socket(self) -> zmq.Socket:
        if self._req is None:
            self._req = self._ctx.socket(zmq.REQ)
            self._req.setsockopt(zmq.LINGER, 0)
            self._req.connect(self._control_addr)
        return self._req

    def _close_req(self) -> None:
        if self._req is not None:
            self._req.close(0)
            self._req = None


class EventReader:
    """A thread reading the messenger's events (it reconnects by itself when the
    messenger restarts: ZeroMQ redials the socket's path) and handing each to `_apply`."""

    name = "yuebing-events"

    def __init__(self, kv_dir: str, node: str) -> None:
        self._addr = events_endpoint(kv_dir, node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _apply(self, event: BlockEvent) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._addr)
        try:
            while not self._stop.is_set():
                if sub.poll(200, zmq.POLLIN):
                    self._apply(event_decoder.decode(sub.recv()))
        except Exception:  # never take the engine down with us; the engine then computes everything
            log.exception("messenger event reader stopped", reader=self.name)
        finally:
            sub.close(0)


class PoolFollower(EventReader):
    """Ready blocks of the node pool, kept current by a thread reading events.

    `alive` turns false when the messenger's ticks stop, so a request waiting for
    blocks gives up at once instead of at its wait deadline.
    """

    name = "yuebing-pool-follower"

    def __init__(self, kv_dir: str, node: str, client: MessengerClient, dead_after_s: float = 2.0) -> None:
        self.client = client
        self.dead_after_s = dead_after_s
        self.ready: set[bytes] = set()
        self.failed: dict[bytes, float] = {}  # hash → when; forgotten after FAILED_MEMORY_S
        self.pool_id = ""
        self.last_tick = 0.0
        super().__init__(kv_dir, node)

    @property
    def alive(self) -> bool:
        return time.monotonic() - self.last_tick < self.dead_after_s

    def has_failed(self, block_hash: bytes) -> bool:
        """Whether the block failed to arrive lately: nobody should wait for it."""
        when = self.failed.get(block_hash)
        return when is not None and time.monotonic() - when < FAILED_MEMORY_S

    def _apply(self, event: BlockEvent) -> None:
        if event.pool_id != self.pool_id:
            self._resync(event.pool_id)
        now = time.monotonic()
        if event.kind == "tick":
            self.last_tick = now
        elif event.kind == "ready":
            self.ready.update(event.hashes)
        elif event.kind == "evicted":
            self.ready.difference_update(event.hashes)
        elif event.kind == "failed":
            self.failed = {h: t for h, t in self.failed.items() if now - t < FAILED_MEMORY_S}
            self.failed.update(dict.fromkeys(event.hashes, now))

    def _resync(self, pool_id: str) -> None:
        """A new pool (first contact, or the messenger restarted): start from its snapshot."""
        reply = self.client.call(Snapshot())
        self.ready = set(reply.ready) if reply is not None and reply.pool_id == pool_id else set()
        self.pool_id = pool_id
        log.info("pool followed", pool_id=pool_id, ready=len(self.ready))


class HelloWatch(EventReader):
    """Says hello again when the messenger's ticks name no pool: it (re)started and
    no engine has carved its pool yet. Engines say hello only at start-up otherwise,
    so a restarted messenger would hold no pool, and decode would wait `kv_wait_s`
    on every request. `hello` runs on this thread (a bounded round trip), at most
    once per `retry_s`; the worker maps the new pool when a step first names it."""

    name = "yuebing-hello-watch"

    def __init__(self, kv_dir: str, node: str, hello: Callable[[], object], retry_s: float = 1.0) -> None:
        self.hello = hello
        self.retry_s = retry_s
        self.said_at = float("-inf")
        super().__init__(kv_dir, node)

    def _apply(self, event: BlockEvent) -> None:
        self.saw(event, time.monotonic())

    def saw(self, event: BlockEvent, now: float) -> bool:
        """Whether this event made us say hello."""
        if event.kind != "tick" or event.pool_id or now - self.said_at < self.retry_s:
            return False
        self.said_at = now
        log.info("messenger holds no pool (it restarted?): saying hello again")
        try:
            self.hello()
        except Exception:  # keep watching: the next tick tries again
            log.exception("hello to a restarted messenger failed")
        return True
