"""Moving block layers over plain TCP streams (`kv_transport: tcp`), one per peer,
read and written by the messenger's own event loop.

The batches are ZeroMQ transport's (services/messenger/transport.py: `Batches`),
sealed with AES-GCM under the cluster's key, or plaintext with --kv-insecure; on the
wire each goes as a fixed prefix (magic, index, seal and payload sizes), its index, the
index's seal, then its payloads. What ZeroMQ adds, an I/O thread per process and a
message it allocates per batch, is what this transport leaves out: the sender's loop
writes the sealed buffer to the socket itself, and the receiver's reads each batch into
a buffer of the connection's own and opens it from there into the pool.
`yuebing bench transfer` measures both: on this 2-core box this transport moved 1.0 to
1.6 times what ZeroMQ did with the same sealing, from 256 KiB layers up.

A receiving connection reads nothing more until the layers of its last batch have been
taken (TCP then holds the sender back). A batch is checked before its payload is read:
its sizes must be within bounds and, sealed, its index must open with the cluster's key,
so a peer without the key cannot make the messenger read or allocate more than a
prefix and an index; one that fails is counted and its connection closed. ZeroMQ CURVE
has no equivalent here: `tcp` takes the cluster key's AES-GCM mode only.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import time
from collections.abc import Callable
from typing import Literal

import structlog

from services.messenger.transport import (
    BATCH_BYTES,
    QUEUE_BATCHES,
    Batches,
    Entry,
    Layer,
    Outbox,
    Rejections,
    Scratch,
    Sealer,
    dropped_counts,
    keep_big_buffers,
    split,
)
from shared.endpoint import parse_endpoint, tcp_endpoint
from shared.kv.keys import ClusterKeys

log = structlog.get_logger(__name__)

MAGIC = b"YBK1"
PREFIX = struct.Struct("<4sIIQ")  # magic, index bytes, seal bytes, payload bytes
INDEX_MAX = 1 << 20  # a batch's index: a header and a few numbers per layer
SEAL_MAX = 64
PAYLOAD_MAX = 1 << 30  # a plaintext layer goes whole: a 70B model's is a few MiB
SOCKET_BYTES = 4 << 20  # kernel buffers each way: a few batches in flight
RECONNECT_S = 0.1  # a peer we could not reach is tried again after this long
CONNECT_TIMEOUT_S = 5.0
CONNECTIONS_MAX = 1024  # streams in from peers at once; more are refused
STALL_S = 10.0  # a stream silent this long before its first batch, or inside one, is closed


Batch = tuple[list[Entry], list[memoryview] | None]


class Incoming:
    """A stream from one peer, on a plain non-blocking socket read when the messenger
    asks for layers rather than by an event-loop callback: a burst of layers can take
    batch after batch with no trip through the loop between them (a trip per batch
    left the receiver waiting on its own loop, with the next batch already in the
    kernel). A batch is read into buffers of the stream's own: its prefix, its index
    and seal, then (once those are checked) its payloads, which stay valid until the
    next batch is read. A stream's first batch is its sender's hello: no layers."""

    def __init__(self, sock: socket.socket, rejections: Rejections, batches: Batches, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # kept: a closed socket forgets it
        self.closed = False
        self.trusted = False  # a batch came in whole (sealed: the peer holds the cluster's key)
        self.progress_at = now  # when it last sent bytes, or connected
        self._rejections, self._batches = rejections, batches
        self._payloads = Scratch()
        self._prefix = memoryview(bytearray(PREFIX.size))
        self._start(self._prefix, self._prefixed)

    def _start(self, buffer: memoryview, then: Callable[[], Batch | None]) -> None:
        self._buffer, self._got, self._then = buffer, 0, then

    def read(self) -> Batch | None | Literal["drained"]:
        """Read on to the end of the next batch: the batch, "drained" when the socket has
        no more for now, None when the stream ended or was refused."""
        while not self.closed:
            try:
                n = self.sock.recv_into(self._buffer[self._got :])
            except BlockingIOError:
                return "drained"
            except OSError:
                n = 0
            if n == 0:
                self.close()
                break
            self._got += n
            self.progress_at = time.monotonic()
            if self._got == len(self._buffer) and (batch := self._then()) is not None:
                self.trusted = True
                return batch
        return None

    def stalled(self, now: float) -> bool:
        """Silent for STALL_S before its first batch, or in the middle of one: a peer
        that is not sending batches (a port scan, a stuck or hostile client) holds a
        stream only that long."""
        between = self._got == 0 and self._buffer is self._prefix
        return (not self.trusted or not between) and now - self.progress_at > STALL_S

    def _prefixed(self) -> None:
        magic, index, seal, payload = PREFIX.unpack(self._prefix)
        if magic != MAGIC or not 0 < index <= INDEX_MAX or seal > SEAL_MAX or not 0 <= payload <= PAYLOAD_MAX:
            self.refuse("a stream that is not batches of layers")
            return
        self._sizes = (index, payload)
        self._start(memoryview(bytearray(index + seal)), self._indexed)

    def _indexed(self) -> Batch | None:
        index_bytes, payload_bytes = self._sizes
        head = bytes(self._buffer)
        entries = self._batches.entries(head[:index_bytes], head[index_bytes:])
        if entries is None:  # counted there
            self.close()
            return None
        if sum(size for _, _, size, _ in entries) != payload_bytes:
            self.refuse("a batch whose sizes do not add up")
            return None
        self._entries = entries
        if not payload_bytes:  # a hello: no layers, nothing more to read
            self._start(self._prefix, self._prefixed)
            return entries, []
        self._start(self._payloads.take(payload_bytes), self._complete)
        return None

    def _complete(self) -> Batch:
        batch = self._entries, split(self._buffer, [size for _, _, size, _ in self._entries])
        self._start(self._prefix, self._prefixed)
        return batch

    def refuse(self, why: str) -> None:
        """A stream out of step cannot be read on: count it and hang up."""
        self._rejections(why)
        self.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class Outgoing(asyncio.Protocol):
    """A stream to one peer: it has room while its write buffer is under the mark."""

    def __init__(self, room: asyncio.Event) -> None:
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.closed = False
        self._room = room

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BYTES)
        self.transport.set_write_buffer_limits(high=QUEUE_BATCHES * BATCH_BYTES)
        self._room.set()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._room.set()

    def data_received(self, data: bytes) -> None:  # peers never answer on this stream
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._room.set()

    @property
    def has_room(self) -> bool:
        return self.transport is not None and not self.paused and not self.closed


class Peer:
    """Our stream to one peer's messenger, opened on the event loop when first needed,
    and again (at most every RECONNECT_S) after it broke."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.stream: Outgoing | None = None
        self.tried_at = float("-inf")
        self.task: asyncio.Task[None] | None = None
        self.unreachable = False

    def open(self, room: asyncio.Event, hello: Callable[[], bytes], now: float) -> None:
        if (self.stream is not None and not self.stream.closed) or (self.task is not None and not self.task.done()):
            return
        if now - self.tried_at < RECONNECT_S:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (tests): opened at the next flush inside one
            return
        self.tried_at = now
        self.task = loop.create_task(self._connect(room, hello), name=f"kv-connect {self.endpoint}")

    async def _connect(self, room: asyncio.Event, hello: Callable[[], bytes]) -> None:
        host, port = parse_endpoint(self.endpoint)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                transport, self.stream = await asyncio.get_running_loop().create_connection(
                    lambda: Outgoing(room), host, port)
            transport.write(hello())  # proves the stream ours before it carries anything, see STALL_S
            self.unreachable = False
        except (OSError, TimeoutError) as e:
            if not self.unreachable:  # once, not at every retry
                log.warning("kv peer unreachable: its layers wait, then drop", endpoint=self.endpoint,
                            error=str(e) or type(e).__name__)
            self.unreachable = True
            room.set()  # its layers wait, and drop after WAIT_MAX_S

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None and self.stream.transport is not None:
            self.stream.transport.abort()


class TcpTransport:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "",
                 keys: ClusterKeys | None = None) -> None:
        keep_big_buffers()
        self.authenticated = keys is not None  # None: plaintext, anyone may send (only with --kv-insecure)
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BYTES)  # accepted streams inherit it
        self.endpoint = tcp_endpoint(advertise_host or host, self._listener.getsockname()[1])
        self._reject = Rejections(self.endpoint)
        self._batches = Batches(Sealer(keys) if keys is not None else None, self._reject)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the streams in are watched on
        self._reaper: asyncio.TimerHandle | None = None
        self._incoming: dict[int, Incoming] = {}  # by descriptor
        self._readable: collections.deque[Incoming] = collections.deque()  # streams with data to read, maybe
        self._arrived = asyncio.Event()
        self._peers: dict[str, Peer] = {}
        self._outbox = Outbox()

    @property
    def rejected(self) -> int:
        return self._reject.count

    @property
    def waiting(self) -> int:
        return self._outbox.waiting

    def attach(self, region: memoryview, place: Callable[[bytes], memoryview | None]) -> None:
        self._batches.place = place

    # --- sending ---------------------------------------------------------------------
    def connect(self, endpoint: str) -> None:
        peer = self._peers.get(endpoint)
        if peer is None:
            parse_endpoint(endpoint)  # a malformed one fails here, not on the loop
            peer = self._peers[endpoint] = Peer(endpoint)
        peer.open(self._outbox.room, self._hello, time.monotonic())

    def disconnect(self, endpoint: str) -> None:
        self._outbox.forget(endpoint)
        peer = self._peers.pop(endpoint, None)
        if peer is not None:
            peer.close()

    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        if endpoint not in self._peers:  # one that broke is opened again at the flush
            self.connect(endpoint)
        self._outbox.queue(endpoint, self._batches.split_layer(header, payload))
        return True

    def flush(self) -> tuple[int, int]:
        """Send what `send` queued, in batches of about BATCH_BYTES, while each peer's
        stream has room; the layers and bytes dropped (a peer gone, or too slow)."""
        now, dropped = time.monotonic(), []
        for endpoint in self._outbox.peers():
            peer = self._peers.get(endpoint)
            if peer is not None:
                peer.open(self._outbox.room, self._hello, now)  # again, if it broke
            stream = peer.stream if peer is not None else None  # None while it connects: no room yet
            gone, _ = self._outbox.pump(endpoint, now, lambda: stream is not None and stream.has_room,
                                        None if peer is None else lambda batch: self._send_batch(stream, batch))
            dropped.extend(gone)
        return dropped_counts(dropped)

    def _send_batch(self, stream: Outgoing | None, batch: list[Layer]) -> bool:
        """Only called while `stream` has room (so it is connected): one write per batch."""
        assert stream is not None and stream.transport is not None
        stream.transport.writelines(self._wire(batch))
        return True

    def _hello(self) -> bytes:
        """A batch of no layers (sealed, with a nonce of its own): what a stream sends first."""
        return b"".join(self._wire([]))

    def _wire(self, batch: list[Layer]) -> list[memoryview | bytes]:
        """`batch` as it goes on a stream: prefix, index and seal in one piece, then the payloads."""
        index, seal, payloads = self._batches.pack(batch)
        head = PREFIX.pack(MAGIC, len(index), len(seal), sum(len(p) for p in payloads)) + index + seal
        return [head, *payloads]

    async def backlog(self) -> None:
        await self._outbox.backlog()

    # --- receiving -------------------------------------------------------------------
    def _serve(self) -> None:
        """Watch the listening socket on the running loop (once)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._listener.setblocking(False)
            self._loop.add_reader(self._listener.fileno(), self._accept)
            self._reaper = self._loop.call_later(STALL_S / 2, self._reap)

    def _reap(self) -> None:
        """Close the streams in that stalled (see `Incoming.stalled`), counted as refused."""
        assert self._loop is not None
        now = time.monotonic()
        for fd, stream in list(self._incoming.items()):
            if stream.stalled(now):
                self._loop.remove_reader(fd)
                stream.refuse(f"a stream silent for {STALL_S:.0f} s before or inside a batch")
                del self._incoming[fd]
                if stream in self._readable:
                    self._readable.remove(stream)
        self._reaper = self._loop.call_later(STALL_S / 2, self._reap)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the peer retries
                log.warning("kv stream not accepted", error=str(e))
                return
            if len(self._incoming) >= CONNECTIONS_MAX:
                self._reject(f"more than {CONNECTIONS_MAX} streams in at once")
                sock.close()
                continue
            sock.setblocking(False)
            stream = Incoming(sock, self._reject, self._batches, time.monotonic())
            self._incoming[stream.fd] = stream
            self._readable.append(stream)  # it may have sent already
            self._arrived.set()

    def _can_read(self, stream: Incoming) -> None:
        """The loop saw data on `stream`: it is read at the next receive, not here."""
        assert self._loop is not None
        self._loop.remove_reader(stream.fd)
        self._readable.append(stream)
        self._arrived.set()

    async def receive(self) -> tuple[bytes, memoryview | None]:
        self._serve()
        while (layer := self.receive_nowait()) is None:
            self._arrived.clear()
            await self._arrived.wait()
        return layer

    def receive_nowait(self) -> tuple[bytes, memoryview | None] | None:
        """The next layer; when every batch read is taken, the next batch from a stream
        with data (the one before it is taken: its buffer can be read into again)."""
        while (layer := self._batches.next()) is None:
            if not self._readable:
                return None
            stream = self._readable[0]
            batch = stream.read()
            if batch == "drained" or batch is None:
                self._readable.popleft()
                self._drained(stream)
            else:
                self._readable.rotate(-1)  # the others' turn next
                self._batches.add(*batch)
        return layer

    def _drained(self, stream: Incoming) -> None:
        """Nothing more on `stream` for now: the loop watches it again (or it is gone)."""
        assert self._loop is not None
        if stream.closed:
            self._incoming.pop(stream.fd, None)
        else:
            self._loop.add_reader(stream.fd, self._can_read, stream)

    async def watch(self) -> None:
        """Refusals are counted where they happen; nothing to wait for here."""
        await asyncio.Event().wait()

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        for fd, stream in self._incoming.items():
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            stream.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._listener.fileno())
        if self._reaper is not None:
            self._reaper.cancel()
        self._listener.close()
