"""Messengers for tests: real pool and SSD files in a temp folder, the transport
replaced by a list of what was sent, and a prefill worker's writes played by hand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from services.messenger.messenger import Messenger
from services.messenger.node_pool import NodePool, PoolOptions
from shared.kv.pool_file import Geometry, checksum
from shared.kv.wire import Hello, Release, Reserve, Written

GEOMETRY = Geometry(layers=3, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")
HELLO = Hello(geometry=GEOMETRY, model="m")


@dataclass
class Recorder:
    """A transport that keeps what it is asked to send."""

    endpoint: str = "tcp://a"
    sent: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    authenticated: bool = True
    rejected: int = 0

    closed: list[str] = field(default_factory=list)

    def attach(self, region, place) -> None:
        pass

    def connect(self, endpoint: str) -> None:
        pass

    def disconnect(self, endpoint: str) -> None:
        self.closed.append(endpoint)

    def send(self, endpoint: str, header: bytes, payload) -> bool:
        self.sent.append((endpoint, header, bytes(payload)))
        return True

    def flush(self) -> tuple[int, int]:
        return 0, 0


def h(i: int) -> bytes:
    return bytes([i]) * 16


def start(folder: Path, name: str = "n", slots: int = 2, attach: bool = True, transport=None,
          fault_injection: bool = False, **pool) -> Messenger:
    """A messenger whose pool holds `slots` blocks of GEOMETRY, attached by an engine's hello."""
    options = PoolOptions(pool_bytes=slots * GEOMETRY.slot_bytes, **pool)
    m = Messenger(name, str(folder / "kv"), options, transport=transport or Recorder(f"tcp://{name}"),
                  fault_injection=fault_injection)
    m.node.peers = {"a": "tcp://a", "b": "tcp://b"}
    if attach:
        assert m.control(HELLO).ok
    return m


def pool(m: Messenger) -> NodePool:
    assert isinstance(m.pool, NodePool)
    return m.pool


def sent(m: Messenger) -> list[tuple[str, bytes, bytes]]:
    return m.node.transport.sent  # type: ignore[attr-defined]


def write_layer(m: Messenger, slot: int, layer: int, fill: int) -> None:
    """A prefill worker copies one layer into its slot and says so."""
    part = pool(m).slots.layer(slot, layer)
    part[:] = bytes([fill]) * len(part)
    block_hash = pool(m).blocks.slots[slot].block_hash  # the block the slot was reserved for
    m.note(Written(pool_id=pool(m).pool_id, layer=layer, slots=[slot], hashes=[block_hash], checksums=[checksum(part)]))


def store(m: Messenger, i: int) -> None:
    """A prefill writes block i (every layer filled with byte i) and finishes."""
    (slot,) = m.control(Reserve(owner=f"w{i}", hashes=[h(i)])).slots
    assert slot >= 0
    for layer in range(GEOMETRY.layers):
        write_layer(m, slot, layer, i)
    m.note(Release(owner=f"w{i}"))


def content(m: Messenger, slot: int) -> set[int]:
    return {b for layer in range(GEOMETRY.layers) for b in bytes(pool(m).slots.layer(slot, layer))}


def deliver(src: Messenger, dst: Messenger) -> None:
    for _, header, payload in sent(src):
        dst.received(header, memoryview(payload))
    sent(src).clear()


@contextlib.asynccontextmanager
async def receiving(m: Messenger) -> AsyncIterator[Messenger]:
    """`m` with its transfers loop running, as the messenger's app runs it (a layer in,
    then what it queued goes out); its transport and `m` closed after."""
    transport = m.node.transport

    async def transfers() -> None:
        while True:
            m.received(*await transport.receive())
            m.node.flush()

    task = asyncio.create_task(transfers())
    try:
        yield m
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        transport.close()
        m.close()
