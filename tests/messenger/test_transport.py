"""The KV plane over real ZeroMQ TCP (loopback), in both modes (AES-GCM sealed
messages, CURVE connections): only a peer that holds the cluster's key can put a
block into a messenger's pool; every other peer is refused, counted and shown on the
metrics page."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq

from services.messenger import transport as transport_module
from services.messenger.messenger import Messenger
from services.messenger.node_pool import PoolOptions
from services.messenger.tcp_transport import TcpTransport
from services.messenger.transport import (
    BATCH_BYTES,
    KV_SECURITY,
    QUEUE_BATCHES,
    Batches,
    KvSecurity,
    Sealer,
    Transport,
    ZmqTransport,
    encode_index,
)
from shared.kv.keys import ClusterKeys, generate_keys
from shared.kv.pool_file import Geometry, checksum
from shared.kv.wire import Hello, LayerFrame, control_encoder
from tests.messenger.nodes import GEOMETRY, h, pool, receiving, sent, start, store
from tests.messenger.test_metrics import page
from yuebing.process import free_port

Frames = list[tuple[bytes, bytes]]
KEYS, OTHER = generate_keys(), generate_keys()


def block_frames(tmp_path, i: int) -> Frames:
    """Every layer of block i, as a messenger sends it: well-formed, right checksums."""
    source = start(tmp_path / f"src{i}", "a", slots=1)
    store(source, i)
    assert source.send_to("b", [h(i)]) == 1
    return [(header, payload) for _, header, payload in sent(source)]


async def eventually(what: str, probe: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def receiver(tmp_path, keys: ClusterKeys | None, security: KvSecurity = "aes-gcm") -> AsyncIterator[Messenger]:
    """Node b's messenger on a real transport, with its transfer and peers loops running."""
    transport = ZmqTransport(keys=keys, security=security)
    m = start(tmp_path / "b", "b", slots=4, transport=transport)

    async def transfers() -> None:
        while True:
            m.received(*await transport.receive())

    async def peers() -> None:
        while True:
            await transport.watch()

    tasks = [asyncio.create_task(transfers()), asyncio.create_task(peers())]
    try:
        yield m
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        transport.close()
        m.close()


def push(endpoint: str, frames: Frames, curve: tuple[bytes, bytes, bytes] | None = None) -> Callable[[], None]:
    """A bare PUSH socket sending `frames`; `curve`: (server key, our public, our secret).
    Returns its close."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(endpoint)
    for header, payload in frames:
        # Never block: a CURVE handshake the server refused drops the only pipe, and a
        # blocking PUSH send with no pipe waits forever (the refusal is counted either way).
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([encode_index([(header, b"", len(payload), 0)]), b"", payload], flags=zmq.NOBLOCK)
    return lambda: sock.close(0)


def member(endpoint: str, frames: Frames, keys: ClusterKeys, security: KvSecurity) -> Callable[[], None]:
    """A messenger's transport with `keys` sending `frames`; returns its close."""
    transport = ZmqTransport(keys=keys, security=security)
    for header, payload in frames:
        assert transport.send(endpoint, header, payload)
    assert transport.flush() == (0, 0)
    return transport.close


def holds(m: Messenger, i: int) -> bool:
    return h(i).hex() in m.snapshot().dram


@pytest.mark.parametrize("security", KV_SECURITY)
async def test_a_peer_with_the_cluster_key_puts_a_block_into_the_pool(tmp_path, security):
    async with receiver(tmp_path, KEYS, security) as b:
        close = member(b.node.transport.endpoint, block_frames(tmp_path, 1), KEYS, security)
        await eventually("block 1 arrives", lambda: holds(b, 1))
        close()
        assert (b.stats().blocks_received, b.security().kv_peers_rejected) == (1, 0)
        assert bytes(pool(b).slots.layer(pool(b).blocks.get(h(1)).index, 2)) == bytes([1]) * GEOMETRY.layer_bytes


Intruder = Callable[[str, Frames, KvSecurity], Callable[[], None]]
INTRUDERS: dict[str, Intruder] = {
    "plaintext": lambda endpoint, frames, _: push(endpoint, frames),
    "curve, another keypair": lambda endpoint, frames, _: push(endpoint, frames, (KEYS.public, OTHER.public,
                                                                                 OTHER.secret)),
    "curve, another server key": lambda endpoint, frames, _: push(endpoint, frames, (OTHER.public, KEYS.public,
                                                                                    KEYS.secret)),
    "another cluster's key": lambda endpoint, frames, security: member(endpoint, frames, OTHER, security),
}


@pytest.mark.parametrize("security", KV_SECURITY)
@pytest.mark.parametrize("intruder", INTRUDERS)
async def test_a_peer_without_the_cluster_key_is_refused_and_counted(tmp_path, intruder, security):
    async with receiver(tmp_path, KEYS, security) as b:
        endpoint = b.node.transport.endpoint
        close_bad = INTRUDERS[intruder](endpoint, block_frames(tmp_path, 2), security)
        await eventually("the intruder refused", lambda: b.security().kv_peers_rejected >= 1)
        # A member's block still gets through, after the intruder's.
        close_good = member(endpoint, block_frames(tmp_path, 3), KEYS, security)
        await eventually("block 3 arrives", lambda: holds(b, 3))
        close_bad()
        close_good()
        assert not holds(b, 2)
        assert b.stats().layers_in == GEOMETRY.layers  # block 3's layers only
        metrics = page(b.stats(), b.security())
        assert metrics[("yuebing_messenger_kv_peers_rejected_total", (("node", "b"),))] >= 1
        assert metrics[("yuebing_messenger_kv_authenticated", (("node", "b"),))] == 1


async def test_an_insecure_messenger_takes_plaintext_blocks_and_says_so(tmp_path):
    async with receiver(tmp_path, None) as b:
        close = push(b.node.transport.endpoint, block_frames(tmp_path, 4))
        await eventually("block 4 arrives", lambda: holds(b, 4))
        close()
        assert page(b.stats(), b.security())[("yuebing_messenger_kv_authenticated", (("node", "b"),))] == 0


def test_a_peer_disconnected_has_its_socket_closed_and_a_send_opens_it_again():
    t = ZmqTransport(keys=KEYS)
    try:
        t.connect("tcp://127.0.0.1:9")
        t.disconnect("tcp://127.0.0.1:9")
        t.disconnect("tcp://127.0.0.1:9")  # twice: nothing left to close
        assert t._peers == {}
        t.send("tcp://127.0.0.1:9", b"h", b"p")  # queued on a fresh socket
        assert list(t._peers) == ["tcp://127.0.0.1:9"]
    finally:
        t.close()


def sealed(frames: Frames, keys: ClusterKeys = KEYS) -> list[bytes]:
    """`frames` as one sealed batch (index, seal, payloads), as a member's transport sends it."""
    batches = Batches(Sealer(keys), reject=print)
    return [bytes(part) for part in batches.seal([(header, payload, 0) for header, payload in frames])]


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize("part", ["index", "payload"])
async def test_a_sealed_batch_altered_on_the_way_is_refused_and_a_genuine_one_still_lands(tmp_path, part):
    # The index is authenticated before any payload is placed, and a payload is opened
    # straight into its slot: an altered one must neither count nor block the genuine one.
    async with receiver(tmp_path, KEYS) as b:
        genuine = sealed(block_frames(tmp_path, 5))
        index, seal, payload = genuine
        bad = [flip(index, len(index) // 2), seal, payload] if part == "index" else [index, seal, flip(payload, 100)]
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(b.node.transport.endpoint)
        sock.send_multipart(bad)
        await eventually("the altered batch refused", lambda: b.security().kv_peers_rejected >= 1)
        # An altered index refuses the whole batch; an altered payload only its own layer.
        assert not holds(b, 5) and b.stats().layers_in == (0 if part == "index" else GEOMETRY.layers - 1)
        sock.send_multipart(genuine)
        await eventually("block 5 lands after all", lambda: holds(b, 5))
        sock.close(0)
        assert bytes(pool(b).slots.layer(pool(b).blocks.get(h(5)).index, 0)) == bytes([5]) * GEOMETRY.layer_bytes


def big_layers(count: int) -> Frames:
    """Layers big enough to go one per batch."""
    return [(b"h%d" % i, bytes(BATCH_BYTES)) for i in range(count)]


async def test_layers_wait_for_a_peer_without_room_and_go_when_it_has_room():
    sender = ZmqTransport(keys=KEYS)
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody there yet: ZeroMQ queues QUEUE_BATCHES, no more
    layers = big_layers(QUEUE_BATCHES + 3)
    for header, payload in layers:
        assert sender.send(endpoint, header, payload)
    assert sender.flush() == (0, 0) and sender.waiting == 3
    peer = ZmqTransport(port=int(endpoint.rsplit(":", 1)[1]), keys=KEYS)
    got: list[bytes] = []
    try:
        deadline = time.monotonic() + 10
        while len(got) < len(layers):
            assert time.monotonic() < deadline, f"{len(got)}/{len(layers)} layers arrived"
            if sender.waiting:
                await sender.backlog()  # woken when the peer takes what ZeroMQ holds
                assert sender.flush() == (0, 0)
            message = peer.receive_nowait()
            if message is None:
                await asyncio.sleep(0.001)
            else:
                got.append(message[0])
        assert got == [header for header, _ in layers] and sender.waiting == 0  # in order, every one
    finally:
        sender.close()
        peer.close()


def test_layers_that_wait_too_long_for_their_peer_are_dropped_and_reported(monkeypatch):
    monkeypatch.setattr(transport_module, "WAIT_MAX_S", 0.05)
    sender = ZmqTransport(keys=KEYS)
    try:
        for header, payload in big_layers(QUEUE_BATCHES + 2):
            sender.send("tcp://127.0.0.1:9", header, payload)  # nobody listens there
        assert sender.flush() == (0, 0) and sender.waiting == 2
        time.sleep(0.06)  # the wait is what is under test
        assert sender.flush() == (2, 2 * BATCH_BYTES) and sender.waiting == 0
    finally:
        sender.close()


async def drain(sender: Transport, timeout_s: float = 10.0) -> None:
    """Flush until nothing waits for the peer's room, as the messenger's backlog loop does."""
    assert sender.flush() == (0, 0)
    deadline = time.monotonic() + timeout_s
    while sender.waiting:
        assert time.monotonic() < deadline, f"{sender.waiting} layers still waiting"
        await sender.backlog()
        assert sender.flush() == (0, 0)


BIG = Geometry(layers=2, shape=(1, 1, BATCH_BYTES * 5 // 2), dtype="uint8", itemsize=1, layout="x")


TRANSPORTS: dict[str, Callable[[], ZmqTransport | TcpTransport]] = {
    "zmq": lambda: ZmqTransport(keys=KEYS), "tcp": lambda: TcpTransport(keys=KEYS),
}


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_layer_bigger_than_a_batch_goes_in_pieces_put_together_in_its_slot(tmp_path, kind):
    transport = TRANSPORTS[kind]()
    b = Messenger("b", str(tmp_path / "kv"), PoolOptions(pool_bytes=2 * BIG.slot_bytes), transport)
    assert b.control(Hello(geometry=BIG, model="m")).ok
    sender = TRANSPORTS[kind]()
    sender.attach(memoryview(bytearray(1)), lambda header: None)  # a messenger's: it cuts big layers
    async with receiving(b):
        try:
            payloads = [os.urandom(BIG.layer_bytes) for _ in range(BIG.layers)]
            assert [start for _, _, start in sender._batches.split_layer(b"h", payloads[0])] == [
                0, BATCH_BYTES, 2 * BATCH_BYTES]
            for layer, payload in enumerate(payloads):
                frame = LayerFrame(block_hash=h(9), layer=layer, checksum=checksum(payload), geometry=BIG, model="m")
                assert sender.send(transport.endpoint, control_encoder.encode(frame), payload)
            await drain(sender)
            await eventually("block 9 put together", lambda: holds(b, 9))
            slot = pool(b).blocks.get(h(9)).index
            assert [bytes(pool(b).slots.layer(slot, layer)) for layer in range(BIG.layers)] == payloads
            assert b.stats().layers_in == BIG.layers and b.security().kv_peers_rejected == 0
        finally:
            sender.close()
