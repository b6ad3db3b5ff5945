"""Moving block layers between messengers. `Transport` is the interface the messenger
uses; `ZmqTransport` implements it over ZeroMQ TCP, `TcpTransport` (tcp_transport.py,
the default) over plain TCP streams, `MooncakeTransport` (mooncake_transport.py) with
Mooncake's Transfer Engine (TCP or RDMA). `Batches` and `Outbox` are what the first
two share: the sealed batches, and the layers waiting for a peer's room.

Sends never block the messenger's event loop. A peer's layers go out in batches of
about a MiB, one ZeroMQ message each, while ZeroMQ has room for that peer (a few
batches); the rest wait in the messenger until it has, and a layer that waits too
long for a peer gone or too slow is dropped (its block is then computed by its
reader). A sealed batch is sealed into one buffer that ZeroMQ sends without a copy,
and opened on arrival straight into the slot the pool gives each layer (`place`),
so every byte is copied by a cipher and the kernel, and by nobody else.

Only the cluster's messengers may put a block into a pool (a planted block with a
matching checksum would poison every request that reuses its prefix). With the
cluster's keys (shared/kv/keys.py), one of two modes (`KV_SECURITY`):
- "aes-gcm": every message is sealed with AES-256-GCM under a key derived from the
  cluster's secret (payload encrypted, header authenticated); one that does not
  open is dropped. Anyone may connect; nobody without the secret gets a block in.
- "curve": every connection is ZeroMQ CURVE (libsodium, which encrypts too): the
  receiving side admits only peers that hold the cluster's secret (the handshake
  proves it, a ZAP check admits only the cluster's public key), and the sending
  side talks only to a peer that holds it too.
Every refused handshake or message is counted (`rejected`) and logged.
`yuebing bench transfer` measures both against plaintext: AES-GCM runs at several
GB/s on one core (AES-NI), CURVE at about 1 GB/s per connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import time
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec
import numpy as np
import structlog
import zmq
import zmq.asyncio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from shared.kv.keys import ClusterKeys, message_key

log = structlog.get_logger(__name__)

# Batches ZeroMQ holds per peer, each way; more wait in the messenger, unsealed, until
# the peer takes them (ZeroMQ's socket wakes the loop when it has room again). A few
# MiB in flight stay in the CPU's cache from the cipher to the kernel and back: at
# 1 MiB a block, 4 queued moved 2.35-2.45 GB/s, 64 queued 1.4; the 20,000 it was
# grew the heap without bound while a peer lagged, a page fault per fresh page.
QUEUE_BATCHES = 4
WAIT_MAX_S = 10.0  # a layer waiting this long for its peer is dropped: its reader computes the block
RETRY_S = 0.01  # while layers wait, a flush at least this often (should a wake-up from ZeroMQ be missed)
# A peer's layers queued in one turn of the event loop go out together, in batches
# of about this many bytes: a ZeroMQ message per 64 KiB layer cost more than the
# layer (bare ZeroMQ moved 1.3-1.7 GB/s in 64 KiB messages, 4-7 GB/s in 1 MiB ones).
BATCH_BYTES = 1 << 20
# Plaintext payloads up to this size are copied into ZeroMQ's message: a zero-copy
# send is released through pyzmq's garbage-collector thread, a wake-up and a GIL
# hand-off per message that cost more than copying a small layer (measured at 64-256
# KiB). A sealed batch is one zero-copy frame: its own buffer, one release per batch.
COPY_MAX_BYTES = 512 << 10


class Transport(Protocol):
    endpoint: str  # where peers reach this messenger
    authenticated: bool  # only the cluster's messengers can send here

    def attach(self, region: memoryview, place: Callable[[bytes], memoryview | None]) -> None:
        """The node's pool (`region`), and `place`: where a layer with this header goes
        in it (None: not wanted). A transport that writes into peers' pools needs them."""

    def connect(self, endpoint: str) -> None:
        """Open the path to a peer early, so its first transfer does not pay for it."""

    def disconnect(self, endpoint: str) -> None:
        """Close the path to a peer that is gone (whatever is still queued for it is dropped)."""

    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        """Queue one layer (header, payload) for a peer, to go at the next `flush`;
        False if it cannot be queued."""

    def flush(self) -> tuple[int, int]:
        """Send what was queued (the messenger calls it after every step of its loops),
        as far as the peers take it; the layers and bytes that could not go."""

    async def backlog(self) -> None:
        """Until some layers wait for a peer's room, and a moment more: time to `flush` again."""

    async def receive(self) -> tuple[bytes, memoryview | None]:
        """The next (header, payload) message from any peer, the payload valid until the
        next receive; payload None: the layer is already where `place` said, to be
        checked there."""

    def receive_nowait(self) -> tuple[bytes, memoryview | None] | None:
        """The next message if one is already here, else None: the messenger drains a
        burst of small layers without an event-loop wake-up per layer."""

    async def watch(self) -> None:
        """Wait for the next refused peer, and count it in `rejected`."""

    @property
    def rejected(self) -> int:
        """Peers refused so far: they could not prove they are the cluster's."""

    def close(self) -> None: ...


def keep_big_buffers() -> None:
    """A transport allocates a buffer per batch (the sealed one it sends; ZeroMQ's per
    message received). glibc serves big ones with a fresh mmap and unmaps it on free,
    so every MiB paid a page fault per 4 KiB; kept on the heap, the memory is reused warm."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc caps it at 32 MiB
    libc.mallopt(m_trim_threshold, 256 << 20)


KvSecurity = Literal["aes-gcm", "curve"]
KV_SECURITY: tuple[KvSecurity, ...] = ("aes-gcm", "curve")
NONCE_BYTES = 12
TAG_BYTES = 16  # AES-GCM's tag, after the ciphertext
ZAP_DOMAIN = "yuebing-kv"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
REJECTION_LOG_S = 10.0  # a plaintext peer retries every 100 ms: log it once in a while, count it always
WHY_REJECTED = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "another security mechanism (plaintext against CURVE, or back)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "CURVE handshake failed: the peer does not hold the cluster's key",
}


def why_rejected(event: dict) -> str:
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its public key is not the cluster's"
    return WHY_REJECTED.get(event["value"], f"handshake failed ({event['value']})")


class ClusterMembers:
    """The ZAP check: only the cluster's public key may connect (CURVE has already
    proved the peer holds its secret)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.public:
            return True
        log.warning("kv peer refused: its public key is not the cluster's", client_key=client_key.decode())
        return False


class Sealer:
    """The "aes-gcm" mode: (header, nonce, payload sealed with the header as associated
    data), so a header cannot be moved onto another payload either.

    Both directions work in a buffer kept from message to message: a fresh multi-MiB
    output per message cost a page fault per 4 KiB (AES-GCM ran at 3.7 GB/s into
    fresh 16 MiB outputs, 10 GB/s into a warm one). So an opened payload is valid
    until the next `open`; `seal` writes where it is told (the batch's buffer)."""

    def __init__(self, keys: ClusterKeys) -> None:
        self._aead = AESGCM(message_key(keys))
        self._opened = Scratch()
        self._nonces = memoryview(b"")

    def _nonce(self) -> bytes:
        # Random 96-bit nonces: safe for 2**32 messages per key (NIST SP 800-38D); the
        # launcher makes a key per cluster run. Drawn a few thousand at a time: one
        # getrandom call per message showed in the profile at 64 KiB.
        if not self._nonces:
            self._nonces = memoryview(os.urandom(NONCE_BYTES * 4096))
        nonce, self._nonces = self._nonces[:NONCE_BYTES], self._nonces[NONCE_BYTES:]
        return bytes(nonce)

    def sealed_bytes(self, payload_bytes: int) -> int:
        return payload_bytes + TAG_BYTES

    def seal(self, aad: bytes, payload: memoryview | bytes, out: memoryview) -> bytes:
        """`payload` sealed into `out` (sealed_bytes long) with `aad` authenticated beside
        it (see `associated`); returns its nonce."""
        nonce = self._nonce()
        self._aead.encrypt_into(nonce, payload, aad, out)
        return nonce

    def open(self, aad: bytes, nonce: bytes, sealed: memoryview) -> memoryview | None:
        """The payload, valid until the next `open`; None if it does not open with our key."""
        if len(sealed) < TAG_BYTES:
            return None
        out = self._opened.take(len(sealed) - TAG_BYTES)
        return out if self.open_into(aad, nonce, sealed, out) else None

    def open_into(self, aad: bytes, nonce: bytes, sealed: memoryview, out: memoryview) -> bool:
        """Open `sealed` into `out` (exactly its payload's size); False, `out` garbled, if it
        does not open with our key."""
        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
            return True
        except (InvalidTag, ValueError):
            return False

    def seal_index(self, index: bytes) -> bytes:
        """A batch's index authenticated (a nonce and AES-GCM's tag over it, nothing
        encrypted), so its headers can be trusted before any payload is opened."""
        nonce = self._nonce()
        return nonce + self._aead.encrypt(nonce, b"", index)

    def opens_index(self, index: bytes, seal: bytes) -> bool:
        try:
            self._aead.decrypt(seal[:NONCE_BYTES], seal[NONCE_BYTES:], index)
            return True
        except (InvalidTag, ValueError):
            return False


class Scratch:
    """A buffer kept for reuse; a bigger one replaces it when a message needs more."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def take(self, size: int) -> memoryview:
        if len(self._buffer) < size:
            self._buffer = bytearray(size)  # the old one lives on while a view holds it
        return memoryview(self._buffer)[:size]


Layer = tuple[bytes, "memoryview | bytes", int]  # (header, payload or a piece of it, where the piece starts)
Entry = tuple[bytes, bytes, int, int]  # a batch's index entry: (layer header, nonce, bytes on the wire, start)
Opened = Literal["last", "piece", "unwanted", "refused"]  # a sealed payload opened into its place
_index_encoder = msgspec.msgpack.Encoder()
_index_decoder = msgspec.msgpack.Decoder(list[tuple[bytes, bytes, int, int]])


def encode_index(index: list[Entry]) -> bytes:
    """A batch's first frame: (layer header, nonce, bytes, start) per payload after it
    (nonce b"": not sealed; start: where a piece of a layer goes in it, else 0). A batch
    is [index, index seal, payloads]: plaintext, no seal and a frame per payload;
    sealed, the seal and every sealed payload in one frame."""
    return _index_encoder.encode(index)


def associated(header: bytes, start: int) -> bytes:
    """What a sealed payload authenticates beside itself: its header and where it goes,
    so neither a header nor a piece's place can be moved onto another payload."""
    return header + start.to_bytes(8, "little")


def pieces(header: bytes, payload: memoryview | bytes) -> list[Layer]:
    """A layer cut into pieces of at most BATCH_BYTES, each to be sealed and opened into
    its place on its own: a 16 MiB layer in flight whole no longer fit the CPU's cache
    beside the others (1 MiB blocks moved 2.1-2.45 GB/s, 4-16 MiB ones 1.7-2.2)."""
    view = memoryview(payload)
    return [(header, view[at : at + BATCH_BYTES], at) for at in range(0, len(view), BATCH_BYTES)]


def decode_index(data: bytes) -> list[Entry] | None:
    try:
        return _index_decoder.decode(data)
    except msgspec.DecodeError:
        return None


def split(frame: memoryview, sizes: list[int]) -> list[memoryview] | None:
    """A sealed batch's one payload frame cut into its payloads (None: the sizes do not add up)."""
    if sum(sizes) != len(frame) or min(sizes, default=0) < 0:
        return None
    out, at = [], 0
    for size in sizes:
        out.append(frame[at : at + size])
        at += size
    return out


def take_batch(waiting: collections.deque[tuple[float, Layer]]) -> list[Layer]:
    """The oldest waiting layers, about BATCH_BYTES of them (one big layer alone)."""
    batch, size = [], 0
    while waiting and size < BATCH_BYTES:
        layer = waiting.popleft()[1]
        batch.append(layer)
        size += len(layer[1])
    return batch


class Rejections:
    """Messages and peers refused: all counted, logged once in a while (a refused peer
    may retry many times a second)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.count = 0
        self._logged_at = float("-inf")

    def __call__(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= REJECTION_LOG_S:
            self._logged_at = now
            log.warning("kv peer rejected", why=why, endpoint=self.endpoint, rejected=self.count)


class Outbox:
    """Layers on their way out, by peer: queued by `send`, sent in batches of about
    BATCH_BYTES while the peer has room; a layer that waits WAIT_MAX_S for a peer gone
    or too slow is dropped (its reader computes the block). `room` is set by the
    transport when a peer may have room again."""

    def __init__(self) -> None:
        self._queued: dict[str, list[Layer]] = {}  # sent, not flushed yet
        self._waiting: dict[str, collections.deque[tuple[float, Layer]]] = {}  # (since, layer) by peer
        self.room = asyncio.Event()

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiting.values())

    def peers(self) -> list[str]:
        """Peers with layers waiting (or queued since the last flush)."""
        return list({**self._waiting, **self._queued})

    def queue(self, endpoint: str, layers: list[Layer]) -> None:
        self._queued.setdefault(endpoint, []).extend(layers)

    def forget(self, endpoint: str) -> None:
        self._queued.pop(endpoint, None)
        self._waiting.pop(endpoint, None)

    def pump(self, endpoint: str, now: float, room: Callable[[], bool],
             send: Callable[[list[Layer]], bool] | None) -> tuple[list[Layer], bool]:
        """Send `endpoint`'s layers while `room()` (send None: the peer is gone), after
        dropping those that waited too long; (the layers dropped, whether some still wait)."""
        waiting = self._waiting.setdefault(endpoint, collections.deque())
        waiting.extend((now, layer) for layer in self._queued.pop(endpoint, ()))
        dropped: list[Layer] = []
        while waiting and (send is None or now - waiting[0][0] >= WAIT_MAX_S):
            dropped.append(waiting.popleft()[1])
        while waiting and send is not None and room():
            batch = take_batch(waiting)
            if not send(batch):
                dropped.extend(batch)
        if not waiting:
            del self._waiting[endpoint]
        return dropped, bool(waiting)

    async def backlog(self) -> None:
        if self._waiting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room.wait(), RETRY_S)
        else:
            await self.room.wait()
        self.room.clear()


def dropped_counts(dropped: list[Layer]) -> tuple[int, int]:
    """(layers, bytes) of what was dropped: a layer in pieces counts once."""
    return len({header for header, _, _ in dropped}), sum(len(payload) for _, payload, _ in dropped)


class Batches:
    """Layers into batches and back, the part every transport that moves batches shares.
    Sealed (a Sealer), a batch is (index, the index's seal, every payload sealed into
    one buffer), and each layer is opened on arrival straight into the place `place`
    gives it in the pool; plaintext, the payloads go as they are."""

    def __init__(self, sealer: Sealer | None, reject: Callable[[str], None]) -> None:
        self.sealer = sealer
        self.place: Callable[[bytes], memoryview | None] | None = None
        self._reject = reject
        self._inbox: collections.deque[tuple[Entry, memoryview]] = collections.deque()

    def split_layer(self, header: bytes, payload: memoryview | bytes) -> list[Layer]:
        """A layer as it is queued: in pieces when it is bigger than a batch, sealed and
        attached here (so at the peer too, which puts the pieces together)."""
        if self.sealer is not None and self.place is not None and len(payload) > BATCH_BYTES:
            return pieces(header, payload)
        return [(header, payload, 0)]

    def pack(self, batch: list[Layer]) -> tuple[bytes, bytes, list[memoryview | bytes]]:
        """(index, its seal, payloads): sealed, every payload sealed into one buffer of this
        batch's own; plaintext, no seal and the payloads as they are."""
        if self.sealer is None:
            return encode_index([(h, b"", len(p), start) for h, p, start in batch]), b"", [p for _, p, _ in batch]
        index, seal, sealed = self.seal(batch)
        return index, seal, [sealed]

    def seal(self, batch: list[Layer]) -> tuple[bytes, bytes, memoryview]:
        """(index, its seal, every payload sealed into one buffer of this batch's own)."""
        assert self.sealer is not None
        sizes = [self.sealer.sealed_bytes(len(p)) for _, p, _ in batch]
        out = memoryview(np.empty(sum(sizes), np.uint8))  # not zeroed: every byte is sealed into
        index, at = [], 0
        for (header, payload, start), size in zip(batch, sizes):
            nonce = self.sealer.seal(associated(header, start), payload, out[at : at + size])
            index.append((header, nonce, size, start))
            at += size
        data = encode_index(index)
        return data, self.sealer.seal_index(data), out

    def entries(self, index: bytes, seal: bytes) -> list[Entry] | None:
        """A batch's index, once it opens with the cluster's key (sealed); None, counted, if not."""
        if self.sealer is not None and not self.sealer.opens_index(index, seal):
            self._reject("a message that does not open with the cluster's key")
            return None
        entries = decode_index(index)
        if entries is None:
            self._reject("a message that is not a batch of layers")
        return entries

    def add(self, entries: list[Entry], payloads: list[memoryview] | None) -> bool:
        """A batch in: its layers wait in the inbox, opened one at a time as they are taken."""
        if payloads is None or len(payloads) != len(entries):
            self._reject("a message that is not a batch of layers")
            return False
        self._inbox.extend(zip(entries, payloads))
        return True

    def next(self) -> tuple[bytes, memoryview | None] | None:
        """The next layer in (payload None: opened in its place already), or None."""
        while self._inbox:
            (header, nonce, _, start), payload = self._inbox.popleft()
            if self.sealer is not None and self.place is not None:
                outcome = self._open_in_place(header, nonce, payload, start)
                if outcome == "last":
                    return header, None  # in its place: the messenger checks it there
                if outcome != "refused":
                    continue  # not wanted here, or a piece before the layer's last
            elif start == 0 and (opened := self._opened(header, nonce, payload)) is not None:
                return header, opened
            self._reject("a message that does not open with the cluster's key, or a piece out of place")
        return None

    def _opened(self, header: bytes, nonce: bytes, payload: memoryview) -> memoryview | None:
        """A whole payload as it came (plaintext) or opened into a buffer (sealed, unattached)."""
        if self.sealer is None:
            return payload
        return self.sealer.open(associated(header, 0), nonce, payload)

    def _open_in_place(self, header: bytes, nonce: bytes, payload: memoryview, start: int) -> Opened:
        """Open a sealed layer, or a piece of one, straight into its layer's place in the
        pool; "last" once the layer's last byte is in (pieces come in order: one stream)."""
        assert self.sealer is not None and self.place is not None
        target = self.place(header)
        if target is None:
            return "unwanted"
        end = start + len(payload) - TAG_BYTES
        if not 0 <= start < end <= len(target):
            return "refused"
        if not self.sealer.open_into(associated(header, start), nonce, payload, target[start:end]):
            return "refused"
        return "last" if end == len(target) else "piece"


class ZmqTransport:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "",
                 keys: ClusterKeys | None = None, security: KvSecurity = "aes-gcm") -> None:
        keep_big_buffers()
        self.authenticated = keys is not None  # None: plaintext, anyone may send (only with --kv-insecure)
        self.keys = keys if security == "curve" else None  # CURVE on the sockets
        self._ctx = zmq.asyncio.Context()
        self._send_ctx = zmq.Context()  # plain sockets: NOBLOCK sends, no futures
        self._auth = self._authenticator(self.keys)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, QUEUE_BATCHES)
        self._pull.setsockopt(zmq.RCVBUF, 8 << 20)
        if self.keys is not None:
            self._pull.curve_server = True
            self._pull.curve_publickey, self._pull.curve_secretkey = self.keys.public, self.keys.secret
            self._pull.zap_domain = ZAP_DOMAIN.encode()
        self._pull_now = zmq.Socket.shadow(self._pull.underlying)  # the same socket, without futures
        self._monitor = self._pull.get_monitor_socket(HANDSHAKE_FAILED)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host or host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}
        self._outbox = Outbox()
        self._watched: set[zmq.Socket] = set()  # peers' sockets the loop watches for room
        self._reject = Rejections(self.endpoint)
        sealer = Sealer(keys) if keys is not None and security == "aes-gcm" else None
        self._batches = Batches(sealer, self._reject)

    def _authenticator(self, keys: ClusterKeys | None) -> AsyncioAuthenticator | None:
        """ZAP runs on the event loop: it answers once per connection, not per layer."""
        if keys is None:
            return None
        auth = AsyncioAuthenticator(self._ctx)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=ClusterMembers(keys.public))
        return auth

    @property
    def rejected(self) -> int:
        return self._reject.count

    @property
    def waiting(self) -> int:
        """Layers waiting for their peer's room."""
        return self._outbox.waiting

    def attach(self, region: memoryview, place: Callable[[bytes], memoryview | None]) -> None:
        """A sealed payload is then opened straight into its place in the pool (no copy
        after); unattached (the notes under MooncakeTransport), it is handed over."""
        self._batches.place = place

    def connect(self, endpoint: str) -> None:
        if endpoint not in self._peers:
            sock = self._send_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, QUEUE_BATCHES)
            sock.setsockopt(zmq.SNDBUF, 8 << 20)
            if self.keys is not None:  # we talk only to a peer that holds the cluster's secret, too
                sock.curve_serverkey = self.keys.public
                sock.curve_publickey, sock.curve_secretkey = self.keys.public, self.keys.secret
            sock.connect(endpoint)
            self._peers[endpoint] = sock

    def disconnect(self, endpoint: str) -> None:
        self._outbox.forget(endpoint)
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            self._watch_room(sock, False)
            sock.close(0)

    def send(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> bool:
        self.connect(endpoint)
        self._outbox.queue(endpoint, self._batches.split_layer(header, payload))
        return True

    def flush(self) -> tuple[int, int]:
        """Send what `send` queued, a peer's layers together in batches of about
        BATCH_BYTES, while the peer has room (the rest waits, see `backlog`); returns
        the layers and bytes that could not go (a peer gone, or too slow for WAIT_MAX_S)."""
        now, dropped = time.monotonic(), []
        for endpoint in self._outbox.peers():
            sock = self._peers.get(endpoint)
            gone, waits = self._outbox.pump(endpoint, now, lambda: bool(sock.get(zmq.EVENTS) & zmq.POLLOUT),
                                            None if sock is None else lambda batch: self._send_batch(sock, batch))
            dropped.extend(gone)
            if sock is not None:
                self._watch_room(sock, waits)
        return dropped_counts(dropped)

    def _watch_room(self, sock: zmq.Socket, on: bool) -> None:
        """Have the event loop wake `backlog` when ZeroMQ signals a change on `sock`
        (its room is then looked at again), while layers wait for it."""
        if on == (sock in self._watched):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # flushed outside a loop (tests): the caller flushes again itself
            return
        if on:
            loop.add_reader(sock.get(zmq.FD), self._outbox.room.set)
            self._watched.add(sock)
        else:
            loop.remove_reader(sock.get(zmq.FD))
            self._watched.discard(sock)

    async def backlog(self) -> None:
        await self._outbox.backlog()

    def _send_batch(self, sock: zmq.Socket, batch: list[Layer]) -> bool:
        index, seal, payloads = self._batches.pack(batch)
        try:
            if self._batches.sealer is None:
                frames: list = [zmq.Frame(p, copy=False) if len(p) > COPY_MAX_BYTES else p for p in payloads]
                sock.send_multipart([index, seal, *frames], flags=zmq.NOBLOCK)
            else:  # the sealed buffer is the batch's own: ZeroMQ sends it without copying
                sock.send_multipart([index, seal, *payloads], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    async def receive(self) -> tuple[bytes, memoryview | None]:
        while (layer := self._batches.next()) is None:
            self._unpack(await self._pull.recv_multipart(copy=False))
        return layer

    def receive_nowait(self) -> tuple[bytes, memoryview | None] | None:
        while (layer := self._batches.next()) is None:
            try:
                self._unpack(self._pull_now.recv_multipart(flags=zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return None
        return layer

    def _unpack(self, frames: list[zmq.Frame]) -> None:
        """A batch in: [index, seal, payloads] (sealed: one frame of every payload)."""
        if len(frames) < 3:
            self._reject("a message that is not a batch of layers")
            return
        entries = self._batches.entries(frames[0].bytes, frames[1].bytes)
        if entries is None:
            return
        payloads: list[memoryview] | None = None
        if self._batches.sealer is None:
            payloads = [f.buffer for f in frames[2:]]
        elif len(frames) == 3:
            payloads = split(frames[2].buffer, [size for _, _, size, _ in entries])
        self._batches.add(entries, payloads)

    async def watch(self) -> None:
        event = parse_monitor_message(await self._monitor.recv_multipart())
        self._reject(why_rejected(event))

    def close(self) -> None:
        for sock in self._peers.values():
            self._watch_room(sock, False)
            sock.close(0)
        self._pull.disable_monitor()
        self._monitor.close(0)
        self._pull.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._send_ctx.term()
        self._ctx.term()
