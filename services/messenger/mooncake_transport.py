"""Moving block layers with Mooncake's Transfer Engine (`kv_transport: mooncake`):
the bytes go by one-sided writes straight into the slot the receiving messenger
reserved for them, over TCP, or RDMA where the node has RDMA NICs; ZeroMQ (a
`ZmqTransport`, sealed with the cluster key like every KV message) carries only the
small notes around each write:

    sender                                   receiver
    Ask([(id, layer header)])    ──zmq──▶    place(): a FILLING slot's layer part, each
                                 ◀──zmq──    Grant(session, [(id, address)])   (0: not wanted)
    engine write: pool → address ══TE══▶     (no receive-side copy)
    Landed([layer header])       ──zmq──▶    checksum the slot's bytes, then the layer counts

Integrity stays with the messengers: Transfer Engine's TCP writes are not
authenticated, so a written layer counts only once an authenticated `Landed` note
(its header carries the layer's checksum) arrives and the slot's bytes match it.
They are not encrypted either: run this transport only where the network (or the
RDMA fabric) is trusted. Payloads that are not in the registered pool (the fault
injector's damaged copies) travel inline over ZeroMQ, as `ZmqTransport` sends them.

Engine writes run on one writer thread (they release the GIL), batched per peer, up to
IN_FLIGHT batches submitted at once; their notes go back to the event loop to be sent.
The writer sleeps through most of a batch's expected time before the engine's wait,
which spins on a core (see `Writer`).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from services.messenger.transport import ZmqTransport

log = structlog.get_logger(__name__)
Placement = Callable[[bytes], memoryview | None]  # a layer header → where its bytes go here, or None
WRITE_BATCH = 64  # engine writes per batch at most
ASKS_MAX = 20_000  # layers asked for and not granted yet, at most: a few prompts' worth
# Batches submitted to the engine before the writer waits for the oldest: the next one
# is already queued in the engine while the writer waits for the GIL (up to the
# interpreter's 5 ms switch interval while the event loop runs) to hand over notes.
IN_FLIGHT = 2
SLEEP_SHARE = 0.8  # of a batch's expected time slept before the engine's (spinning) wait
RATE_WEIGHT = 0.5  # of the last batch in the engine's rate estimate
OVERSLEPT_S = 50e-6  # a wait this short found the batch over already
SLEEP_MAX_S = 0.05  # a stalled peer's batch lowers the estimate: never sleep longer than this
RDMA_DEVICES = "/sys/class/infiniband"


class MooncakeUnavailable(RuntimeError):
    """The engine cannot load or start here: --kv-transport mooncake must not start."""


def engine_protocol() -> str:
    """RDMA where the node has RDMA devices, TCP elsewhere."""
    try:
        return "rdma" if os.listdir(RDMA_DEVICES) else "tcp"
    except OSError:
        return "tcp"


def why_unavailable() -> str:
    """Why the engine cannot load here ("" if it can): checked before a cluster starts,
    so that `--kv-transport mooncake` fails at once rather than in every messenger."""
    # The engine logs a line at INFO for every async batch it waits for (hundreds a
    # second): keep its warnings and errors, unless the operator sets MC_LOG_LEVEL.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:  # no wheel, or libibverbs.so.1 missing (the wheel links it even for TCP)
        return (f"Mooncake Transfer Engine cannot load ({e}): install the project's `mooncake` extra "
                "(mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine with CUDA) and libibverbs.so.1 "
                "(Debian: apt-get install libibverbs1); or use --kv-transport zmq")
    return ""


def load_engine(host: str, protocol: str = "") -> Any:
    """A started Transfer Engine listening on `host` (P2P handshake, no metadata
    server), or MooncakeUnavailable saying what is missing."""
    if why := why_unavailable():
        raise MooncakeUnavailable(why)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    protocol = protocol or engine_protocol()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
        raise MooncakeUnavailable(f"Mooncake Transfer Engine did not start on {host} over {protocol}")
    return engine


def address_of(view: memoryview) -> int:
    """Where a writable buffer starts in memory (the temporary export ends at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class Ask(msgspec.Struct, tag="ask"):
    """Where should these layers go? (id, the layer's header) each."""

    reply_to: str  # the sender's endpoint
    layers: list[tuple[int, bytes]]


class Grant(msgspec.Struct, tag="grant"):
    """(id, address) each; address 0: not wanted there (complete already, no room)."""

    session: str  # the receiver's engine ("host:port")
    layers: list[tuple[int, int]]


class Landed(msgspec.Struct, tag="landed"):
    """These layers (their headers, with their checksums) are written where granted."""

    frames: list[bytes]


Note = Ask | Grant | Landed
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Note).decode


@dataclass(frozen=True)
class Write:
    endpoint: str
    frame: bytes
    source: int
    length: int
    session: str = ""
    target: int = 0


@dataclass(frozen=True)
class Submitted:
    """One engine batch on its way: its writes (one peer's), its id (0: refused), when and how big."""

    writes: list[Write]
    batch: int
    at: float
    nbytes: int


class Writer:
    """Engine batches without a spinning wait. The engine's own waits (a sync write, or
    the status of an async batch) poll its status in a loop that never yields, so a
    waiting writer took a core; on a small host that core is what the engine's own
    I/O threads and the messengers' loops needed (at 64 KiB the wait cost about 0.5 s
    of CPU per GiB moved, more than either messenger's event loop). So the writer
    sleeps until shortly before a batch should be done, by the rate the last batches
    ran at, then waits."""

    def __init__(self, engine: Any, rate: float = 10e9) -> None:
        self.engine = engine
        # Bytes/s the engine moved lately; at first above any TCP rate, so the first
        # batches are waited for (spinning) rather than overslept.
        self.rate = rate
        self._done_at = 0.0  # when the last batch ended: the next one ran from then on, or from its start

    def submit(self, writes: list[Write]) -> list[Submitted]:
        """`writes` submitted to the engine, one batch per peer."""
        out = []
        for session in {w.session for w in writes}:
            mine = [w for w in writes if w.session == session]
            batch = self.engine.batch_transfer_async_write(
                session, [w.source for w in mine], [w.target for w in mine], [w.length for w in mine])
            refused = not 0 < batch < 1 << 63  # 0, or the binding's -1 as an unsigned id
            out.append(Submitted(mine, 0 if refused else batch, time.monotonic(), sum(w.length for w in mine)))
        return out

    def wait(self, s: Submitted) -> bool:
        """Until the batch ends; whether every write of it landed."""
        if not s.batch:
            return False
        began = max(s.at, self._done_at)
        expected = min(SLEEP_SHARE * s.nbytes / self.rate, SLEEP_MAX_S)
        time.sleep(max(0.0, began + expected - time.monotonic()))
        woke = time.monotonic()
        ok = self.engine.get_batch_transfer_status([s.batch]) == 0
        self._done_at = time.monotonic()
        if ok and self._done_at > began:
            self._learn(s.nbytes / (self._done_at - began), self._done_at - woke)
        return ok

    def _learn(self, measured: float, spun: float) -> None:
        """The rate from one batch. One already over when the writer woke ran faster than
        it measures (the writer overslept it): the estimate goes up beyond it, so that a
        low estimate (a slow start, a peer that stalled) does not keep the engine idle."""
        self.rate += RATE_WEIGHT * (measured - self.rate)
        if spun < OVERSLEPT_S:
            self.rate *= 1.5


class MooncakeTransport:
    """`Transport` with Transfer Engine writes for the bytes; `notes` (a ZmqTransport)
    is the sealed channel for everything else. Notes are batched: the asks made in one
    step of the messenger go out as one message per peer (at `flush`), and so do their
    grants and the landed notes of one batch of writes, so small layers do not pay
    three messages each. An ask never answered (its peer gone) is forgotten when the
    peer is disconnected."""

    def __init__(self, notes: ZmqTransport, host: str = "127.0.0.1", protocol: str = "") -> None:
        self.engine = load_engine(host, protocol)
        self.notes = notes
        self.endpoint = notes.endpoint
        self.authenticated = notes.authenticated
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.protocol = protocol or engine_protocol()
        self._place: Placement = lambda frame: None
        self._region: tuple[int, int] = (0, 0)  # the registered pool: start, end
        self._asked: dict[int, Write] = {}  # sent asks not answered yet, by id
        self._asks: dict[str, list[tuple[int, bytes]]] = {}  # asks to send at the end of this turn, by peer
        self._arrived: collections.deque[bytes] = collections.deque()  # landed layers for the messenger
        self._ids = itertools.count(1)
        self._writes: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer = Writer(self.engine)
        self._thread = threading.Thread(target=self._write_forever, name="mooncake-writer", daemon=True)
        self._thread.start()
        self.written = 0  # layers the engine wrote into peers' pools
        self.inline = 0  # layers sent inline over ZeroMQ (not in the registered pool)
        self.write_failures = 0
        log.info("mooncake transfer engine", session=self.session, protocol=self.protocol)

    # --- set-up ------------------------------------------------------------------------
    def attach(self, region: memoryview, place: Placement) -> None:
        """Register the node's pool with the engine: peers write into it, we send from it."""
        start = address_of(region)
        if self.engine.register_memory(start, len(region)) != 0:
            raise MooncakeUnavailable(f"Mooncake Transfer Engine could not register {len(region)} bytes of pool")
        self._region = (start, start + len(region))
        self._place = place

    @property
    def rejected(self) -> int:
        return self.notes.rejected

    def connect(self, endpoint: str) -> None:
        self.notes.connect(endpoint)

    def disconnect(self, endpoint: str) -> None:
        self._asked = {i: w for i, w in self._asked.items() if w.endpoint != endpoint}
        self._asks.pop(endpoint, None)
        self.notes.disconnect(endpoint)

    # --- sending -----------------------------------------------------------------------
    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        source = self._source(payload)
        if source is None:  # not in the pool: inline, as ZeroMQ sends it
            self.inline += 1
            return self.notes.send(endpoint, header, payload)
        if len(self._asked) >= ASKS_MAX:
            return False
        ask = next(self._ids)
        self._asked[ask] = Write(endpoint, header, source, len(payload))
        self._asks.setdefault(endpoint, []).append((ask, header))
        return True

    def flush(self) -> tuple[int, int]:
        """The asks of this turn, one message per peer, then every note queued."""
        asks, self._asks = self._asks, {}
        for endpoint, layers in asks.items():
            self.notes.send(endpoint, _encode(Ask(self.endpoint, layers)), b"")
        return self.notes.flush()

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = self._loop or asyncio.get_running_loop()
        return self._loop

    def _source(self, payload: memoryview | bytes) -> int | None:
        if isinstance(payload, bytes) or payload.readonly or not len(payload):
            return None
        start = address_of(payload)
        return start if self._region[0] <= start and start + len(payload) <= self._region[1] else None

    def _granted(self, grant: Grant) -> None:
        for ask, address in grant.layers:
            write = self._asked.pop(ask, None)
            if write is not None and address:  # else: a peer forgotten meanwhile, or the block not wanted there
                self._writes.put(Write(write.endpoint, write.frame, write.source, write.length, grant.session, address))

    def _write_forever(self) -> None:
        """The writer thread: engine writes in batches per peer, then their notes on the loop."""
        in_flight: collections.deque[Submitted] = collections.deque()
        while (writes := self._next_writes(wait=not in_flight)) is not None:
            in_flight.extend(self._writer.submit(writes))
            if not writes or len(in_flight) >= IN_FLIGHT:
                self._finish(in_flight.popleft())
        for submitted in in_flight:  # closing: what the engine took ends before the pool is unregistered
            self._writer.wait(submitted)

    def _next_writes(self, wait: bool) -> list[Write] | None:
        """Up to WRITE_BATCH queued writes ([] if none and not `wait`); None: closing."""
        try:
            first = self._writes.get(block=wait)
        except queue.Empty:
            return []
        writes: list[Write] = []
        while first is not None:
            writes.append(first)
            if len(writes) == WRITE_BATCH or self._writes.empty():
                return writes
            first = self._writes.get()
        self._writes.put(None)  # closing after this batch
        return writes or None

    def _finish(self, submitted: Submitted) -> None:
        ok = self._writer.wait(submitted)
        assert self._loop is not None  # set by the receive or send that led here
        self._loop.call_soon_threadsafe(self._landed, submitted.writes, ok)

    def _landed(self, writes: list[Write], ok: bool) -> None:
        if not ok:  # the receiver's slots stay unfilled: their readers compute those blocks
            self.write_failures += len(writes)
            log.warning("mooncake write failed", session=writes[0].session, layers=len(writes))
            return
        self.written += len(writes)
        for endpoint in {w.endpoint for w in writes}:
            self.notes.send(endpoint, _encode(Landed([w.frame for w in writes if w.endpoint == endpoint])), b"")
        self.notes.flush()  # called from the writer thread's hand-off, not from a loop step

    # --- receiving ---------------------------------------------------------------------
    async def receive(self) -> tuple[bytes, memoryview | None]:
        self._on_loop()
        while not self._arrived:
            layer = self._take(*await self.notes.receive())
            if layer is not None:
                return layer
        return self._arrived.popleft(), None

    def receive_nowait(self) -> tuple[bytes, memoryview | None] | None:
        while not self._arrived:
            message = self.notes.receive_nowait()
            if message is None:
                return None
            layer = self._take(*message)
            if layer is not None:
                return layer
        return self._arrived.popleft(), None

    def _take(self, header: bytes, payload: memoryview) -> tuple[bytes, memoryview] | None:
        """An inline layer for the messenger, or None for a note handled here (landed
        layers queue in `_arrived`)."""
        if len(payload):
            return header, payload
        try:
            note = _decode(header)
        except msgspec.DecodeError:
            log.warning("bad mooncake note dropped")
            return None
        if isinstance(note, Landed):
            self._arrived.extend(note.frames)
        elif isinstance(note, Grant):
            self._granted(note)
        else:
            self._grant(note)
        return None

    def _grant(self, ask: Ask) -> None:
        layers = []
        for i, frame in ask.layers:
            place = self._place(frame)
            layers.append((i, address_of(place) if place is not None else 0))
        self.notes.send(ask.reply_to, _encode(Grant(self.session, layers)), b"")
        self.notes.flush()  # now: receive() goes on waiting for a layer, no loop step ends here

    async def watch(self) -> None:
        await self.notes.watch()

    async def backlog(self) -> None:
        await self.notes.backlog()

    def close(self) -> None:
        self._writes.put(None)
        self._thread.join(timeout=5)
        if self._region[0]:  # before the messenger unmaps the pool: no peer may write into it after
            self.engine.unregister_memory(self._region[0])
            self._region = (0, 0)
        self.notes.close()
