"""The messenger's logic between two nodes, with the transport replaced by a list
(the real ZeroMQ path runs in tests/e2e/test_transfer.py and `bench transfer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from services.messenger.messenger import Messenger, PoolOptions
from shared.kv_pool import Geometry, checksum
from shared.kv_wire import Hello, Pin, Reserve, Written, control_encoder, frame_decoder

GEOMETRY = Geometry(layers=3, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")


@dataclass
class Recorder:
    endpoint: str = "tcp://a"
    sent: list[tuple[str, bytes, bytes]] = field(default_factory=list)

    def connect(self, endpoint: str) -> None:
        pass

    def send(self, endpoint: str, header: bytes, payload) -> bool:
        self.sent.append((endpoint, header, bytes(payload)))
        return True


def node(tmp_path, name: str, stream: bool = True, slots: int = 4, **pool) -> Messenger:
    options = PoolOptions(pool_bytes=slots * GEOMETRY.slot_bytes, stream_layers=stream, **pool)
    m = Messenger(name, str(tmp_path), options, transport=Recorder(f"tcp://{name}"))
    assert m.control(Hello(geometry=GEOMETRY, model="m")).ok
    m.peers = {"a": "tcp://a", "b": "tcp://b"}
    return m


def write_layer(m: Messenger, slot: int, layer: int, fill: int) -> None:
    part = m.file.layer(slot, layer)
    part[:] = bytes([fill]) * len(part)
    m.written(Written(pool_id=m.pool_id, layer=layer, slots=[slot], checksums=[checksum(part)]))


def deliver(src: Messenger, dst: Messenger) -> None:
    for _, header, payload in src.transport.sent:
        dst.received(header, memoryview(payload))
    src.transport.sent.clear()


@pytest.mark.parametrize("stream", [True, False])
def test_layers_stream_as_written_or_go_together_at_the_end(tmp_path, stream):
    a, b = node(tmp_path / "a", "a", stream), node(tmp_path / "b", "b")
    slot = a.control(Reserve(owner="r1", hashes=[b"x" * 16], dest="b")).slots[0]
    write_layer(a, slot, 0, 7)
    assert len(a.transport.sent) == (1 if stream else 0)  # layer 0 left before layer 1 was computed
    write_layer(a, slot, 1, 8)
    write_layer(a, slot, 2, 9)
    assert len(a.transport.sent) == 3
    assert [e.kind for e in a.take_events()] == ["ready"]
    deliver(a, b)
    events = b.take_events()
    assert [(e.kind, e.hashes) for e in events] == [("ready", [b"x" * 16])]
    (got,) = b.control(Pin(owner="d1", hashes=[b"x" * 16])).slots
    assert bytes(b.file.layer(got, 2)) == bytes([9]) * GEOMETRY.layer_bytes
    assert b.stats().blocks_received == 1


def test_a_corrupted_layer_is_detected_and_the_block_never_shows(tmp_path):
    a, b = node(tmp_path / "a", "a"), node(tmp_path / "b", "b")
    a.corrupt_next = 1
    slot = a.control(Reserve(owner="r1", hashes=[b"y" * 16], dest="b")).slots[0]
    for layer in range(3):
        write_layer(a, slot, layer, 1)
    deliver(a, b)
    assert [e.kind for e in b.take_events()] == ["failed"]
    assert b.control(Pin(owner="d", hashes=[b"y" * 16])).slots == []
    assert b.stats().checksum_failures == 1 and a.stats().corrupted_on_purpose == 1


def test_a_block_arriving_at_a_pool_with_no_room_is_reported_failed_at_once(tmp_path):
    # Decode's pool is full of pinned blocks: the engine waiting for the arriving block
    # hears it will not come (and computes it) instead of waiting out kv_wait_s.
    a, b = node(tmp_path / "a", "a"), node(tmp_path / "b", "b", slots=1)
    assert b.control(Reserve(owner="busy", hashes=[b"p" * 16])).slots == [0]  # b's only slot, pinned
    b.take_events()
    slot = a.control(Reserve(owner="r1", hashes=[b"q" * 16], dest="b")).slots[0]
    for layer in range(3):
        write_layer(a, slot, layer, 2)
    deliver(a, b)
    assert [(e.kind, e.hashes) for e in b.take_events()] == [("failed", [b"q" * 16])]  # once, not per layer


def test_a_block_already_in_the_pool_is_sent_without_being_written_again(tmp_path):
    a, b = node(tmp_path / "a", "a"), node(tmp_path / "b", "b")
    slot = a.control(Reserve(owner="r1", hashes=[b"z" * 16]))  # no destination
    for layer in range(3):
        write_layer(a, slot.slots[0], layer, 3)
    assert a.transport.sent == []
    again = a.control(Reserve(owner="r2", hashes=[b"z" * 16], dest="b"))
    assert again.slots == [-1]  # nothing to write: it is here
    deliver(a, b)
    assert [e.kind for e in b.take_events()] == ["ready"]


def test_a_pull_sends_only_the_blocks_the_puller_lacks(tmp_path):
    a = node(tmp_path / "a", "a")
    hashes = [bytes([i]) * 16 for i in range(3)]
    for h in hashes:
        slot = a.control(Reserve(owner="r1", hashes=[h])).slots[0]
        for layer in range(3):
            write_layer(a, slot, layer, 5)
    # b holds the first block already: two blocks travel, and b will hold three.
    assert a.send_to("b", hashes, skip=1) == 3
    assert len(a.transport.sent) == 2 * GEOMETRY.layers
    assert {frame_decoder.decode(header).block_hash for _, header, _ in a.transport.sent} == set(hashes[1:])
    a.transport.sent.clear()
    assert a.send_to("b", [hashes[0], b"?" * 16, hashes[2]]) == 1  # only the leading run it holds
    assert len(a.transport.sent) == GEOMETRY.layers


def test_a_second_engine_with_another_geometry_is_refused(tmp_path):
    a = node(tmp_path, "a")
    other = Geometry(layers=2, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")
    reply = a.control(Hello(geometry=other, model="m"))
    assert not reply.ok and "not m blocks" in reply.error


def test_frames_of_another_geometry_are_dropped(tmp_path):
    a, b = node(tmp_path / "a", "a"), node(tmp_path / "b", "b")
    b.received(b"not msgpack", memoryview(b"x"))
    slot = a.control(Reserve(owner="r", hashes=[b"w" * 16], dest="b")).slots[0]
    write_layer(a, slot, 0, 1)
    _, header, payload = a.transport.sent[0]
    b.received(header, memoryview(payload[:-1]))  # wrong length
    frame = frame_decoder.decode(header)
    for other in (msgspec.structs.replace(frame, geometry=msgspec.structs.replace(GEOMETRY, layout="y")),
                  msgspec.structs.replace(frame, model="another model"),
                  msgspec.structs.replace(frame, v=frame.v + 1)):
        b.received(control_encoder.encode(other), memoryview(payload))
    assert b.take_events() == [] and b.stats().layers_in == 0
    b.received(header, memoryview(payload))  # the frame itself is fine
    assert b.stats().layers_in == 1
