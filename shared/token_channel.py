"""Token channels: a decode instance's tokens for one gateway over a direct TCP
connection instead of through nats-server.

Each engine step's TokenBatch for a gateway is one frame, the same bytes NATS would
carry. The gateway listens (`ChannelServer`) and names its endpoint and a key of its
own in every DecodeRequest; the decode instance connects on first need (`Channels`)
and keeps the connection for every later request from that gateway. NATS stays the
way for everything else, and for tokens whenever no channel is up: a stream that
starts while its gateway's channel is not ready stays on NATS to its end, and one
whose channel closes goes on over NATS, so a stream's chunks never take two ways at
once except across a failure, which the gateway sees as a gap in its chunk numbers
(the same `Lost` as a message NATS lost). Dynamo's runtime streams responses the same
way: requests over its request plane, responses back over a TCP stream.

On the wire (gateway G, decode D):
- G → D, on accept: 16 random bytes, G's nonce.
- D → G: 16 random bytes, D's nonce, then frames; the first is D's instance id (the
  hello). G answers a hello that opens with one byte (ACK); D sends tokens after it.
- A frame: its length (4 bytes, big-endian), then the payload sealed with AES-GCM
  under the connection's key, the length as associated data, the frame's number as
  its nonce. The connection's key is BLAKE2b of both nonces keyed with the gateway's
  key: a fresh key per connection, so a frame number never repeats under one key and
  a frame recorded on one connection opens on no other. Numbers must follow in order.
G reads nothing but a small hello from a peer that has not proved the key, and
closes a connection whose hello does not come within HANDSHAKE_S or any frame that
does not open."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import struct
import time
from collections.abc import Callable

import structlog
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shared.endpoint import parse_endpoint, tcp_endpoint

log = structlog.get_logger(__name__)

KEY_BYTES = 32  # the gateway's key, sent to decode instances inside DecodeRequests (over NATS)
NONCE_BYTES = 16
TAG_BYTES = 16  # AES-GCM's
LENGTH = struct.Struct(">I")
ACK = b"\x01"
HELLO_MAX = 256  # a sealed instance id: all a peer without the key gets read of it
FRAME_MAX = 64 << 20  # a step's batch, prompt logprobs of a long prompt included
HANDSHAKE_S = 5.0  # from accept to a hello that opens
CONNECT_TIMEOUT_S = 5.0  # connect, nonces and ack
RETRY_S = 1.0  # after a failed connect, requests stream over NATS this long before the next try
CONNECTIONS_MAX = 1024  # decode instances connected to one gateway at once; more are refused
CHANNELS_MAX = 256  # gateways one decode instance keeps channels to
WRITE_BUFFER_MAX = 16 << 20  # unsent bytes to a gateway that does not read: the channel closes
# Sent bytes unacknowledged this long (a gateway's host gone, the network between cut
# while NATS still carries the rest): the kernel closes the channel, and its streams go
# on over NATS, instead of TCP's retransmissions for a quarter of an hour.
UNACKED_MS = 10_000


class ChannelError(Exception):
    """A peer broke the protocol (bad length, a frame that does not open)."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def connection_key(key: bytes, gateway_nonce: bytes, decode_nonce: bytes) -> bytes:
    return hashlib.blake2b(gateway_nonce + decode_nonce, key=key, digest_size=32, person=b"yuebing-tokens").digest()


class Sealed:
    """One direction of one connection: payloads into frames, in order, or back."""

    def __init__(self, key: bytes) -> None:
        self.aead = AESGCM(key)
        self.number = 0  # the next frame's, its nonce

    def _nonce(self) -> bytes:
        nonce = self.number.to_bytes(12, "big")
        self.number += 1
        return nonce

    def seal(self, payload: bytes) -> bytes:
        head = LENGTH.pack(len(payload) + TAG_BYTES)
        return head + self.aead.encrypt(self._nonce(), payload, head)

    def open(self, head: bytes, sealed: bytes) -> bytes:
        try:
            return self.aead.decrypt(self._nonce(), sealed, head)
        except InvalidTag:
            raise ChannelError("a frame did not open with the gateway's key") from None


class Frames:
    """Bytes as they arrive → whole frames (length, sealed payload), at most `limit` long."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self.buffer += data
        frames, at = [], 0
        with memoryview(self.buffer) as view:  # one copy of each frame, not a slice and then its bytes
            while len(view) - at >= LENGTH.size:
                (size,) = LENGTH.unpack_from(view, at)
                if not TAG_BYTES <= size <= self.limit:
                    raise ChannelError(f"a frame of {size} bytes (at most {self.limit})")
                end = at + LENGTH.size + size
                if len(view) < end:
                    break
                frames.append((bytes(view[at : at + LENGTH.size]), bytes(view[at + LENGTH.size : end])))
                at = end
        del self.buffer[:at]  # the view released: a bytearray with one cannot shrink
        return frames


class Incoming(asyncio.Protocol):
    """One decode instance's connection into the gateway."""

    def __init__(self, server: ChannelServer) -> None:
        self.server = server
        self.nonce = os.urandom(NONCE_BYTES)
        self.frames = Frames(HELLO_MAX)
        self.sealed: Sealed | None = None  # once the peer's nonce came
        self.peer = ""  # its instance id, once its hello opened
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= CONNECTIONS_MAX:
            log.warning("token channel refused: too many connections", connections=len(self.server.connections))
            transport.close()
            return
        self.server.connections.add(self)
        self.transport.write(self.nonce)  # type: ignore[union-attr]
        self.timer = asyncio.get_running_loop().call_later(HANDSHAKE_S, self._stalled)

    def data_received(self, data: bytes) -> None:
        try:
            if self.sealed is None:
                self.frames.buffer += data
                data = b""
                if not self._took_nonce():
                    return
            for head, sealed in self.frames.feed(data):
                payload = self.sealed.open(head, sealed)  # type: ignore[union-attr]
                if self.peer:
                    self.server.frames += 1
                    self.server.deliver(payload)
                else:
                    self._hello(payload)
        except ChannelError as e:
            self.server.rejected += 1
            log.warning("token channel closed", peer=self.peer or "(no hello)", error=str(e))
            self.close()

    def _took_nonce(self) -> bool:
        """The peer's nonce, once its 16 bytes are in: the connection's key from it."""
        if len(self.frames.buffer) < NONCE_BYTES:
            return False
        theirs = bytes(self.frames.buffer[:NONCE_BYTES])
        del self.frames.buffer[:NONCE_BYTES]
        self.sealed = Sealed(connection_key(self.server.key, self.nonce, theirs))
        return True

    def _hello(self, payload: bytes) -> None:
        self.peer = payload.decode("utf-8", "replace")  # at most HELLO_MAX bytes: the frame's bound
        self.frames.limit = FRAME_MAX
        if self.timer is not None:
            self.timer.cancel()
        self.transport.write(ACK)  # type: ignore[union-attr]
        log.info("token channel open", peer=self.peer)

    def _stalled(self) -> None:
        self.server.rejected += 1
        log.warning("token channel closed: no hello that opens", timeout_s=HANDSHAKE_S)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server.connections.discard(self)
        if self.peer:
            log.info("token channel gone", peer=self.peer, error=str(exc) if exc else "")


class ChannelServer:
    """The gateway's end: decode instances connect, and each frame's payload (a
    TokenBatch's bytes) goes to `deliver`, on the loop, in the order it was sent."""

    def __init__(self, deliver: Callable[[bytes], None], key: bytes | None = None) -> None:
        self.deliver = deliver
        self.key = key or new_key()
        self.connections: set[Incoming] = set()
        self.rejected = 0  # connections closed for a bad hello, a bad frame or none in time
        self.frames = 0  # payloads delivered
        self.endpoint = ""  # "tcp://host:port" decode instances reach it on, once started
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0, advertise_host: str = "") -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Incoming(self), host, port)
        bound = self._server.sockets[0].getsockname()[1]
        self.endpoint = tcp_endpoint(advertise_host or host, bound)
        return self.endpoint

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()


class Channel:
    """One decode instance's connection to one gateway: `send` writes a payload as one
    frame while the channel is `ready` (connected, its hello acknowledged)."""

    def __init__(self, endpoint: str, key: bytes, instance_id: str,
                 on_close: Callable[[Channel], None] = lambda _: None) -> None:
        self.endpoint, self.key, self.instance_id = endpoint, key, instance_id
        self.on_close = on_close
        self.ready = False
        self.closed = False
        self.opened = False  # was ever ready (closed and never opened: it failed to connect)
        self.closed_at = 0.0
        self.sealed: Sealed | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"token channel {endpoint}")

    def send(self, payload: bytes) -> bool:
        """Write one frame (False: not ready, or now closed: send it another way)."""
        if not self.ready:  # its writer and seal are there once it is
            return False
        transport = self.writer.transport  # type: ignore[union-attr]
        closing = transport.is_closing()
        if closing or transport.get_write_buffer_size() > WRITE_BUFFER_MAX:
            if not closing:
                log.warning("token channel closed: the gateway does not read", endpoint=self.endpoint)
            self.close()
            return False
        transport.write(self.sealed.seal(payload))  # type: ignore[union-attr]
        return True

    async def _run(self) -> None:
        try:
            reader = await asyncio.wait_for(self._connect(), CONNECT_TIMEOUT_S)
            self.ready = self.opened = not self.closed
            log.info("token channel open", endpoint=self.endpoint)
            while await reader.read(64):  # the gateway sends nothing more: this ends when it closes
                pass
            log.info("token channel gone", endpoint=self.endpoint)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ChannelError) as e:
            log.warning("token channel failed: tokens go over NATS", endpoint=self.endpoint,
                        error=str(e) or type(e).__name__)
        finally:
            self.close()

    async def _connect(self) -> asyncio.StreamReader:
        host, port = parse_endpoint(self.endpoint)
        reader, self.writer = await asyncio.open_connection(host, port)
        sock = self.writer.get_extra_info("socket")
        if hasattr(socket, "TCP_USER_TIMEOUT") and sock is not None:  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_MS)
        theirs = await reader.readexactly(NONCE_BYTES)
        ours = os.urandom(NONCE_BYTES)
        self.sealed = Sealed(connection_key(self.key, theirs, ours))
        self.writer.write(ours + self.sealed.seal(self.instance_id.encode()))
        if await reader.readexactly(len(ACK)) != ACK:
            raise ChannelError("the gateway did not acknowledge the hello")
        return reader

    def close(self) -> None:
        self.ready = False
        if self.writer is not None:
            self.writer.close()
        if not self.closed:
            self.closed, self.closed_at = True, time.monotonic()
            self.on_close(self)


class Channels:
    """A decode instance's channels, one per gateway endpoint, each opened on first need."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.open: dict[str, Channel] = {}
        self.failed: dict[str, float] = {}  # endpoint → when its last channel failed to open

    def get(self, endpoint: str, key: bytes) -> Channel | None:
        """The channel to `endpoint`, opening one if none is (None: no endpoint, a bad
        one, or a recent failure: the tokens go over NATS)."""
        if not endpoint or len(key) != KEY_BYTES:
            return None
        channel = self.open.get(endpoint)
        if channel is not None and channel.key == key:
            return channel  # ready, or still connecting
        if channel is not None:  # the gateway's old key: it restarted on the same endpoint
            channel.close()
        if time.monotonic() - self.failed.get(endpoint, -RETRY_S) < RETRY_S or len(self.open) >= CHANNELS_MAX:
            return None
        try:
            parse_endpoint(endpoint)
        except ValueError as e:
            log.warning("no token channel", error=str(e))
            return None
        channel = self.open[endpoint] = Channel(endpoint, key, self.instance_id, self._closed)
        return channel

    def _closed(self, channel: Channel) -> None:
        """A channel closed: out, and, if it never opened, its endpoint held off for RETRY_S."""
        if self.open.get(channel.endpoint) is channel:
            del self.open[channel.endpoint]
        if not channel.opened:
            now = channel.closed_at
            self.failed = {e: t for e, t in self.failed.items() if now - t < RETRY_S}
            self.failed[channel.endpoint] = now

    async def close(self) -> None:
        channels = list(self.open.values())
        for channel in channels:
            channel.close()
            channel.task.cancel()
        await asyncio.gather(*(c.task for c in channels), return_exceptions=True)
