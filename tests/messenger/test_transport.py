"""The KV plane over real ZeroMQ TCP (loopback), in both modes (AES-GCM sealed
messages, CURVE connections): only a peer that holds the cluster's key can put a
block into a messenger's pool; every other peer is refused, counted and shown on the
metrics page."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq

from services.messenger.messenger import Messenger
from services.messenger.transport import KV_SECURITY, KvSecurity, ZmqTransport, encode_index
from shared.kv.keys import ClusterKeys, generate_keys
from tests.messenger.nodes import GEOMETRY, h, pool, sent, start, store
from tests.messenger.test_metrics import page

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
            sock.send_multipart([encode_index([(header, b"", len(payload))]), b"", payload], flags=zmq.NOBLOCK)
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
