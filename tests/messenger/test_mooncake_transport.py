"""The KV plane over Mooncake's Transfer Engine (TCP loopback here): a block moves by
one-sided writes into the slot the receiver placed it in, and counts only once a
sealed note says so and the slot's bytes match its checksum. The placement rules
themselves run without the engine."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from services.messenger import mooncake_transport
from services.messenger.app import kv_transport
from services.messenger.messenger import Messenger
from services.messenger.mooncake_transport import (
    SLEEP_MAX_S,
    MooncakeTransport,
    MooncakeUnavailable,
    Write,
    Writer,
    load_engine,
)
from services.messenger.tcp_transport import TcpTransport
from services.messenger.transport import ZmqTransport
from shared.config import ClusterConfig
from shared.kv.keys import generate_keys
from shared.kv.pool_file import checksum
from shared.kv.wire import LayerFrame, Pin, Reserve, control_encoder
from tests.messenger.nodes import GEOMETRY, h, pool, receiving, start, write_layer
from tests.messenger.test_transport import eventually, holds

KEYS = generate_keys()


def engine_missing() -> str:
    try:
        load_engine("127.0.0.1", "tcp")
    except MooncakeUnavailable as e:
        return str(e)
    return ""


WHY_NOT = engine_missing()
needs_engine = pytest.mark.skipif(bool(WHY_NOT), reason=f"Mooncake Transfer Engine cannot load: {WHY_NOT}")


def header(i: int, layer: int, fill: int) -> bytes:
    part = bytes([fill]) * GEOMETRY.layer_bytes
    return control_encoder.encode(LayerFrame(block_hash=h(i), layer=layer, checksum=checksum(part),
                                             geometry=GEOMETRY, model="m"))


def test_a_layer_written_in_place_counts_only_when_the_slot_holds_what_its_note_says(tmp_path):
    b = start(tmp_path / "b", "b", slots=2)
    place = b.place(header(1, 0, 5))
    assert place is not None and len(place) == GEOMETRY.layer_bytes
    assert b.place(header(1, 0, 5)) is not None  # the same slot while it fills
    place[:] = bytes([6]) * len(place)  # not what the note's checksum says: an unauthenticated write
    b.received(header(1, 0, 5), None)
    assert [e.kind for e in b.node.take_events()] == ["failed"]
    assert b.stats().checksum_failures == 1 and not holds(b, 1)


def test_layers_written_in_place_make_a_block_ready_without_a_copy(tmp_path):
    b = start(tmp_path / "b", "b", slots=2)
    for layer in range(GEOMETRY.layers):
        place = b.place(header(2, layer, 9))
        place[:] = bytes([9]) * len(place)
        b.received(header(2, layer, 9), None)
    assert [(e.kind, e.hashes) for e in b.node.take_events()] == [("ready", [h(2)])]
    assert b.place(header(2, 0, 9)) is None  # complete here: not wanted again
    b.received(header(3, 0, 9), None)  # never placed: nothing to check, dropped
    assert b.stats().layers_in == GEOMETRY.layers and not holds(b, 3)


@contextlib.asynccontextmanager
async def node(tmp_path, name: str, **kw) -> AsyncIterator[Messenger]:
    """A messenger on a real MooncakeTransport (notes sealed with KEYS), its transfer loop running."""
    transport = MooncakeTransport(ZmqTransport(keys=KEYS), "127.0.0.1", "tcp")
    async with receiving(start(tmp_path / name, name, slots=4, transport=transport, **kw)) as m:
        yield m


@needs_engine
async def test_a_block_moves_by_engine_writes_into_the_receivers_slot(tmp_path):
    async with node(tmp_path, "a", fault_injection=True) as a, node(tmp_path, "b") as b:
        a.node.peers = {"b": b.node.transport.endpoint}
        slot = a.control(Reserve(owner="r", hashes=[h(1)], dest="b")).slots[0]
        for layer in range(GEOMETRY.layers):
            write_layer(a, slot, layer, 10 + layer)
        a.node.flush()
        await eventually("block 1 arrives", lambda: holds(b, 1))
        (got,) = b.control(Pin(owner="d", hashes=[h(1)])).slots
        assert bytes(pool(b).slots.layer(got, 2)) == bytes([12]) * GEOMETRY.layer_bytes
        assert b.stats().blocks_received == 1 and b.security().kv_authenticated
        assert (a.node.transport.written, a.node.transport.inline) == (GEOMETRY.layers, 0)  # by the engine, all
        # A damaged layer (the fault injector's copy goes inline) is caught on arrival.
        a.node.faults.corrupt_next = 1
        slot = a.control(Reserve(owner="r2", hashes=[h(4)], dest="b")).slots[0]
        for layer in range(GEOMETRY.layers):
            write_layer(a, slot, layer, 4)
        a.node.flush()
        await eventually("the damaged block fails", lambda: b.stats().checksum_failures == 1)
        assert not holds(b, 4) and a.node.transport.inline == 1


def hide_mooncake(monkeypatch) -> None:
    """Imports of the engine fail, as where its wheel or libibverbs.so.1 is missing."""
    import builtins

    real_import = builtins.__import__

    def no_mooncake(name, *args, **kwargs):
        if name.startswith("mooncake"):
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)


def test_an_engine_that_cannot_load_says_what_to_install(monkeypatch):
    hide_mooncake(monkeypatch)
    with pytest.raises(MooncakeUnavailable, match="libibverbs1.*--kv-transport zmq"):
        load_engine("127.0.0.1")


def messenger_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(host="127.0.0.1", port=0, advertise_host="", kv_key_file=None, kv_insecure=True,
                              kv_security="aes-gcm", **kw)


def test_a_messenger_asked_for_an_engine_that_cannot_load_stops_saying_why(monkeypatch):
    def cannot_load(host: str, protocol: str = ""):
        raise MooncakeUnavailable("Mooncake Transfer Engine cannot load (libibverbs.so.1: cannot open ...)")

    monkeypatch.setattr(mooncake_transport, "load_engine", cannot_load)
    with pytest.raises(SystemExit, match="--kv-transport mooncake: .*libibverbs"):
        kv_transport(ClusterConfig(kv_transport="mooncake"), messenger_args())
    with pytest.raises(SystemExit, match="kv_transport must be one of zmq, tcp, mooncake"):
        kv_transport(ClusterConfig(kv_transport="rdma"), messenger_args())
    default = kv_transport(ClusterConfig(), messenger_args())  # needs no engine
    assert isinstance(default, TcpTransport)
    default.close()
    zmq_transport = kv_transport(ClusterConfig(kv_transport="zmq"), messenger_args())
    assert isinstance(zmq_transport, ZmqTransport)
    zmq_transport.close()


class SlowEngine:
    """An engine whose async batches take `seconds` each, one after the other; the
    test reads when its spinning wait was entered."""

    def __init__(self, seconds: float, refuse: bool = False, fail: bool = False) -> None:
        self.seconds, self.refuse, self.fail = seconds, refuse, fail
        self.ends: dict[int, float] = {}
        self.waited_at: list[float] = []

    def batch_transfer_async_write(self, session, sources, targets, lengths) -> int:
        if self.refuse:
            return (1 << 64) - 1  # the binding's -1, unsigned
        start = max([time.monotonic(), *self.ends.values()])
        self.ends[len(self.ends) + 1] = start + self.seconds
        return len(self.ends)

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        self.waited_at.append(time.monotonic())
        while time.monotonic() < self.ends[batches[0]]:  # as the engine waits: spinning
            pass
        return -1 if self.fail else 0


def writes(n: int, session: str = "s", length: int = 1 << 20) -> list[Write]:
    return [Write("e", b"h", 4096 * i, length, session, 8192 * i) for i in range(n)]


def test_the_writer_sleeps_through_most_of_a_batch_before_the_engines_spinning_wait():
    engine = SlowEngine(0.05)
    writer = Writer(engine, rate=(4 << 20) / 0.05)  # the rate it ran at: 4 MiB in 50 ms
    (submitted,) = writer.submit(writes(4))
    assert writer.wait(submitted)
    assert engine.waited_at[0] - submitted.at >= 0.8 * 0.05 - 0.005  # slept, then waited
    assert writer.rate == pytest.approx((4 << 20) / 0.05, rel=0.3)


def test_the_writer_batches_per_peer_and_reports_refused_and_failed_batches():
    engine = SlowEngine(0.0)
    both = Writer(engine).submit(writes(2, "s1") + writes(3, "s2"))
    assert sorted(len(s.writes) for s in both) == [2, 3] and all(Writer(engine).wait(s) for s in both)
    engine.refuse = True
    (refused,) = Writer(engine).submit(writes(1))
    assert refused.batch == 0 and not Writer(engine).wait(refused)
    engine.refuse, engine.fail = False, True
    (failed,) = Writer(engine).submit(writes(1))
    assert not Writer(engine).wait(failed)


def test_a_stalled_batch_never_makes_the_writer_sleep_long():
    engine = SlowEngine(0.0)
    writer = Writer(engine, rate=1.0)  # a byte a second: a stalled peer dragged the estimate down
    (submitted,) = writer.submit(writes(1))
    started = time.monotonic()
    assert writer.wait(submitted)
    assert time.monotonic() - started < SLEEP_MAX_S + 0.05
