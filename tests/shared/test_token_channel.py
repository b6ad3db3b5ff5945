"""Token channels on real sockets: frames arrive whole and in order, only from a peer
holding the gateway's key; a channel that closes or never opens says so, and the
outbox then sends its chunks over NATS."""

import asyncio
import os
import socket

import msgspec
import pytest

from shared.endpoint import parse_endpoint
from shared.messages import TokenBatch, TokenChunk
from shared.outbox import Outbox
from shared.token_channel import (
    ACK,
    KEY_BYTES,
    NONCE_BYTES,
    UNACKED_MS,
    ChannelError,
    Channels,
    ChannelServer,
    Frames,
    Sealed,
    connection_key,
)


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


class Gateway:
    """A ChannelServer on loopback, what it delivers kept."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.server = ChannelServer(self.got.append)

    async def __aenter__(self) -> "Gateway":
        await self.server.start("127.0.0.1")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.close()


def test_a_frame_opens_once_whole_and_only_in_order():
    key = os.urandom(32)
    sender, receiver, frames = Sealed(key), Sealed(key), Frames(1 << 20)
    wire = sender.seal(b"one") + sender.seal(b"two")
    assert frames.feed(wire[:5]) == []  # a frame in pieces waits for the rest
    got = frames.feed(wire[5:])
    assert [receiver.open(head, sealed) for head, sealed in got] == [b"one", b"two"]
    with pytest.raises(ChannelError):  # frame 0 again: its number is past
        receiver.open(*Frames(1 << 20).feed(Sealed(key).seal(b"one"))[0])
    with pytest.raises(ChannelError):
        Frames(64).feed(Sealed(key).seal(b"x" * 100))


async def test_a_decode_instance_streams_batches_over_its_channel_in_order():
    async with Gateway() as gw:
        channels = Channels("decode-0")
        channel = channels.get(gw.server.endpoint, gw.server.key)
        await until(lambda: channel.ready)
        assert channels.get(gw.server.endpoint, gw.server.key) is channel  # one per gateway
        for n in range(50):
            assert channel.send(b"batch %d" % n)
        await until(lambda: len(gw.got) == 50)
        assert gw.got == [b"batch %d" % n for n in range(50)]
        await channels.close()
        assert not channel.ready and not channel.send(b"late")


async def test_a_channel_with_the_wrong_key_never_gets_ready_and_delivers_nothing():
    async with Gateway() as gw:
        channels = Channels("decode-0")
        channel = channels.get(gw.server.endpoint, os.urandom(KEY_BYTES))
        await until(lambda: channel.closed)
        assert not channel.opened and gw.got == [] and gw.server.rejected == 1
        # Held off for a while: its requests go over NATS meanwhile.
        assert channels.get(gw.server.endpoint, gw.server.key) is None
        await channels.close()


def _raw_connect(endpoint: str) -> socket.socket:
    sock = socket.create_connection(parse_endpoint(endpoint), timeout=5)
    assert len(sock.recv(NONCE_BYTES)) == NONCE_BYTES
    return sock


async def test_a_peer_without_the_key_is_read_no_further_than_a_small_hello():
    async with Gateway() as gw:
        sock = await asyncio.to_thread(_raw_connect, gw.server.endpoint)
        # A length far past a hello's: closed before any of it is read.
        await asyncio.to_thread(sock.sendall, os.urandom(NONCE_BYTES) + (1 << 30).to_bytes(4, "big"))
        assert await asyncio.to_thread(sock.recv, 1) == b""
        sock.close()
        await until(lambda: not gw.server.connections)
        assert gw.server.rejected == 1 and gw.got == []


async def test_a_peer_that_never_says_hello_is_closed(monkeypatch):
    monkeypatch.setattr("shared.token_channel.HANDSHAKE_S", 0.2)  # 5 s in service
    async with Gateway() as gw:
        sock = await asyncio.to_thread(_raw_connect, gw.server.endpoint)
        assert await asyncio.to_thread(sock.recv, 1) == b""
        sock.close()
        assert gw.server.rejected == 1


async def test_a_frame_replayed_onto_another_connection_does_not_open():
    async with Gateway() as gw:
        sock = await asyncio.to_thread(_raw_connect, gw.server.endpoint)
        # Sealed under some other connection's nonces: the gateway's key, but not this connection's.
        forged = Sealed(connection_key(gw.server.key, os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)))
        await asyncio.to_thread(sock.sendall, os.urandom(NONCE_BYTES) + forged.seal(b"decode-x"))
        assert await asyncio.to_thread(sock.recv, 1) == b""
        sock.close()
        assert gw.server.rejected == 1


async def test_a_channel_whose_gateway_goes_away_is_no_longer_ready():
    gw = Gateway()
    await gw.server.start("127.0.0.1")
    channels = Channels("decode-0")
    channel = channels.get(gw.server.endpoint, gw.server.key)
    await until(lambda: channel.ready)
    await gw.server.close()
    await until(lambda: channel.closed)
    assert not channel.send(b"late") and channels.open == {}
    await channels.close()


async def test_no_channel_for_a_bad_endpoint_or_key():
    channels = Channels("decode-0")
    assert channels.get("", os.urandom(KEY_BYTES)) is None
    assert channels.get("tcp://127.0.0.1:1", b"short") is None
    assert channels.get("http://127.0.0.1:80", os.urandom(KEY_BYTES)) is None
    await channels.close()


class Nats:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.sent.append((subject, [c.seq for c in msgspec.json.decode(payload, type=TokenBatch).chunks]))


async def test_the_outbox_sends_over_a_ready_channel_and_over_nats_once_it_closed():
    async with Gateway() as gw:
        channels = Channels("decode-0")
        channel = channels.get(gw.server.endpoint, gw.server.key)
        await until(lambda: channel.ready)
        nats = Nats()
        outbox = Outbox(nats)
        outbox.send("g1", TokenChunk(request_id="a", seq=0, token_ids=[1]), channel)
        await outbox.flush()
        await until(lambda: len(gw.got) == 1)
        assert [c.seq for c in msgspec.json.decode(gw.got[0], type=TokenBatch).chunks] == [0]
        channel.close()  # queued for the channel, which closed before the batch left: NATS takes it
        outbox.send("g1", TokenChunk(request_id="a", seq=1, token_ids=[2]), channel)
        await outbox.flush()
        assert nats.sent == [("g1", [1])] and (outbox.batches, outbox.channelled) == (2, 1)
        await channels.close()


async def test_a_frame_that_does_not_open_after_the_hello_closes_the_connection():
    async with Gateway() as gw:
        def speak() -> bytes:
            sock = socket.create_connection(parse_endpoint(gw.server.endpoint), timeout=5)
            theirs, ours = sock.recv(NONCE_BYTES), os.urandom(NONCE_BYTES)
            sealed = Sealed(connection_key(gw.server.key, theirs, ours))
            sock.sendall(ours + sealed.seal(b"decode-raw"))
            assert sock.recv(1) == ACK
            good, bad = sealed.seal(b"first"), bytearray(sealed.seal(b"second"))
            bad[-1] ^= 1  # one bit of its tag
            sock.sendall(good + bytes(bad))
            closed = sock.recv(1)
            sock.close()
            return closed

        assert await asyncio.to_thread(speak) == b""
        assert gw.got == [b"first"] and gw.server.rejected == 1


async def test_a_channel_gives_up_on_bytes_its_gateway_never_acknowledges():
    async with Gateway() as gw:
        channels = Channels("decode-0")
        channel = channels.get(gw.server.endpoint, gw.server.key)
        await until(lambda: channel.ready)
        sock = channel.writer.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == UNACKED_MS
        await channels.close()
