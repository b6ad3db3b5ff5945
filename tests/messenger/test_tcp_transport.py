"""The KV plane over plain TCP streams (`kv_transport: tcp`), on real loopback
sockets: a member's sealed batches land in the pool; anything else (another cluster's
key, bytes that are not batches, sizes out of bounds, an altered payload) is refused,
counted, and its stream closed before the messenger reads or allocates its payload;
layers wait for a peer that is not there yet and go when it is."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from services.messenger import transport as transport_module
from services.messenger.app import kv_transport
from services.messenger.messenger import Messenger
from services.messenger.tcp_transport import INDEX_MAX, MAGIC, PREFIX, SEAL_MAX, TcpTransport
from shared.endpoint import parse_endpoint
from services.messenger.transport import encode_index
from shared.config import ClusterConfig
from shared.kv.keys import ClusterKeys
from tests.messenger.nodes import GEOMETRY, h, pool, receiving, start
from tests.messenger.test_transport import KEYS, OTHER, Frames, block_frames, drain, eventually, flip, holds, sealed
from yuebing.process import free_port


@contextlib.asynccontextmanager
async def receiver(tmp_path, keys: ClusterKeys | None, port: int = 0) -> AsyncIterator[Messenger]:
    """Node b's messenger on a TcpTransport, its transfers loop running."""
    async with receiving(start(tmp_path / "b", "b", slots=4, transport=TcpTransport(port=port, keys=keys))) as m:
        yield m


async def send_all(sender: TcpTransport, endpoint: str, frames: Frames) -> None:
    """Queue `frames` for `endpoint` and flush until none waits, as the messenger's loops do."""
    for header, payload in frames:
        assert sender.send(endpoint, header, payload)
    await drain(sender)


@contextlib.asynccontextmanager
async def raw(endpoint: str, data: bytes) -> AsyncIterator[asyncio.StreamReader]:
    """A bare TCP client that wrote `data`; its reader (at EOF once the messenger hangs up)."""
    host, port = parse_endpoint(endpoint)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        yield reader
    finally:
        writer.close()


def on_the_wire(batch: list[bytes]) -> bytes:
    index, seal, payload = batch
    return PREFIX.pack(MAGIC, len(index), len(seal), len(payload)) + index + seal + payload


def intrude(endpoint: str, data: bytes) -> Callable[[], None]:
    """A bare TCP client (blocking) that wrote `data`; returns its close."""
    sock = socket.create_connection(parse_endpoint(endpoint), timeout=5)
    sock.sendall(data)
    return sock.close


def plaintext(frames: Frames) -> bytes:
    """`frames` as one batch of an insecure (--kv-insecure) messenger: no seal."""
    index = encode_index([(header, b"", len(payload), 0) for header, payload in frames])
    payload = b"".join(payload for _, payload in frames)
    return PREFIX.pack(MAGIC, len(index), 0, len(payload)) + index + payload


# Well-formed batches (right layout, right checksums) from outside the cluster.
INTRUDERS: dict[str, Callable[[str, Frames], Callable[[], None]]] = {
    "plaintext": lambda endpoint, frames: intrude(endpoint, plaintext(frames)),
    "another cluster's key": lambda endpoint, frames: intrude(endpoint, on_the_wire(sealed(frames, OTHER))),
}


async def hung_up(reader: asyncio.StreamReader) -> bool:
    """Whether the messenger closed the stream (a reset, when it left bytes unread)."""
    async with asyncio.timeout(10):
        try:
            return await reader.read() == b""
        except ConnectionResetError:
            return True


@pytest.mark.parametrize("keys", [KEYS, None], ids=["aes-gcm", "plaintext"])
async def test_a_member_puts_a_block_into_the_pool(tmp_path, keys):
    async with receiver(tmp_path, keys) as b:
        sender = TcpTransport(keys=keys)
        try:
            await send_all(sender, b.node.transport.endpoint, block_frames(tmp_path, 1))
            await eventually("block 1 arrives", lambda: holds(b, 1))
        finally:
            sender.close()
        assert (b.stats().blocks_received, b.security().kv_peers_rejected) == (1, 0)
        assert b.security().kv_authenticated == (keys is not None)
        assert bytes(pool(b).slots.layer(pool(b).blocks.get(h(1)).index, 2)) == bytes([1]) * GEOMETRY.layer_bytes


@pytest.mark.parametrize("intruder", INTRUDERS)
async def test_a_peer_without_the_cluster_key_is_refused_and_its_stream_closed(tmp_path, intruder):
    async with receiver(tmp_path, KEYS) as b:
        endpoint = b.node.transport.endpoint
        close = INTRUDERS[intruder](endpoint, block_frames(tmp_path, 2))
        await eventually("the intruder refused", lambda: b.security().kv_peers_rejected == 1)
        close()
        assert not holds(b, 2) and not b.node.transport._incoming  # its stream closed
        sender = TcpTransport(keys=KEYS)  # a member still gets through
        try:
            await send_all(sender, endpoint, block_frames(tmp_path, 3))
            await eventually("block 3 arrives", lambda: holds(b, 3))
        finally:
            sender.close()
        assert b.stats().layers_in == GEOMETRY.layers  # block 3's only


BAD_PREFIXES = {
    "not a batch": b"GET / HTTP/1.1\r\n\r\n    ",
    "an index too big": PREFIX.pack(MAGIC, INDEX_MAX + 1, 28, 100),
    "a seal too big": PREFIX.pack(MAGIC, 10, SEAL_MAX + 1, 100),
}


@pytest.mark.parametrize("what", BAD_PREFIXES)
async def test_a_stream_that_is_not_batches_is_refused_before_anything_is_read(tmp_path, what):
    async with receiver(tmp_path, KEYS) as b:
        async with raw(b.node.transport.endpoint, BAD_PREFIXES[what]) as intruder:
            assert await hung_up(intruder)
        assert b.security().kv_peers_rejected == 1 and b.stats().layers_in == 0


async def test_sizes_that_do_not_add_up_are_refused_before_the_payload_is_read(tmp_path):
    async with receiver(tmp_path, KEYS) as b:
        index, seal, payload = sealed(block_frames(tmp_path, 4))
        # The index opens, but it announces more payload than its layers hold.
        lying = PREFIX.pack(MAGIC, len(index), len(seal), len(payload) + 1) + index + seal
        async with raw(b.node.transport.endpoint, lying) as intruder:
            assert await hung_up(intruder)
        assert b.security().kv_peers_rejected == 1 and not holds(b, 4)


async def test_an_altered_payload_is_refused_layer_by_layer(tmp_path):
    async with receiver(tmp_path, KEYS) as b:
        index, seal, payload = sealed(block_frames(tmp_path, 5))
        async with raw(b.node.transport.endpoint, on_the_wire([index, seal, flip(payload, 100)])):
            await eventually("the altered layer refused", lambda: b.security().kv_peers_rejected >= 1)
            await eventually("the others in", lambda: b.stats().layers_in == GEOMETRY.layers - 1)
            assert not holds(b, 5)


async def test_layers_wait_for_a_peer_not_there_yet_and_go_once_it_is(tmp_path):
    port = free_port()
    sender = TcpTransport(keys=KEYS)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        frames = block_frames(tmp_path, 6)
        for header, payload in frames:
            sender.send(endpoint, header, payload)
        assert sender.flush() == (0, 0) and sender.waiting == len(frames)  # refused: they wait
        async with receiver(tmp_path, KEYS, port=port) as b:
            await send_all(sender, endpoint, [])  # tried again, until the peer takes them
            await eventually("block 6 arrives", lambda: holds(b, 6))
    finally:
        sender.close()


async def test_a_peer_that_restarts_gets_a_new_stream(tmp_path):
    port = free_port()
    sender = TcpTransport(keys=KEYS)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        async with receiver(tmp_path / "first", KEYS, port=port) as b:
            await send_all(sender, endpoint, block_frames(tmp_path, 1))
            await eventually("block 1 arrives", lambda: holds(b, 1))
        async with receiver(tmp_path / "second", KEYS, port=port) as b:
            await eventually("the broken stream noticed", lambda: sender._peers[endpoint].stream.closed)
            await send_all(sender, endpoint, block_frames(tmp_path, 2))
            await eventually("block 2 arrives on the new stream", lambda: holds(b, 2))
    finally:
        sender.close()


async def test_layers_that_wait_too_long_are_dropped_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(transport_module, "WAIT_MAX_S", 0.05)
    sender = TcpTransport(keys=KEYS)
    try:
        frames, nobody = block_frames(tmp_path, 7), f"tcp://127.0.0.1:{free_port()}"
        for header, payload in frames:
            sender.send(nobody, header, payload)
        assert sender.flush() == (0, 0)
        await asyncio.sleep(0.06)  # the wait is what is under test
        assert sender.flush() == (len(frames), sum(len(p) for _, p in frames)) and sender.waiting == 0
    finally:
        sender.close()


@pytest.mark.parametrize("endpoint", ["tcp://h:1", "tcp://10.0.0.1:65535", "tcp://[::1]:5555"])
def test_endpoints_parse(endpoint):
    host, port = parse_endpoint(endpoint)
    assert f"{host}:{port}" in endpoint.replace("[", "").replace("]", "")


@pytest.mark.parametrize("endpoint", ["ipc:///x", "tcp://h", "tcp://h:0", "tcp://h:70000", "tcp://:5", "tcp://h:x"])
def test_malformed_endpoints_are_refused(endpoint):
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


def test_tcp_takes_the_aes_gcm_mode_only():
    args = argparse.Namespace(host="127.0.0.1", port=0, advertise_host="", kv_key_file=None, kv_insecure=True,
                              kv_security="curve")
    with pytest.raises(SystemExit, match="kv_transport tcp seals with AES-GCM only"):
        kv_transport(ClusterConfig(kv_transport="tcp"), args)
