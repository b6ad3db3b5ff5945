"""The messenger between two nodes, with the transport replaced by a list (the real
ZeroMQ path runs in tests/e2e/test_transfer.py and `bench transfer`); and its pool
before and after the first engine attaches."""

from __future__ import annotations

import msgspec
import pytest

from shared.kv.pool_file import Geometry
from shared.kv.wire import Hello, Pin, Reserve, Snapshot, Written, control_encoder, frame_decoder, pool_path
from tests.messenger.nodes import GEOMETRY, HELLO, Recorder, deliver, h, pool, sent, start, store, write_layer


@pytest.mark.parametrize("stream", [True, False])
def test_layers_stream_as_written_or_go_together_at_the_end(tmp_path, stream):
    a, b = start(tmp_path / "a", "a", slots=4, stream_layers=stream), start(tmp_path / "b", "b", slots=4)
    slot = a.control(Reserve(owner="r1", hashes=[h(1)], dest="b")).slots[0]
    write_layer(a, slot, 0, 7)
    assert len(sent(a)) == (1 if stream else 0)  # layer 0 left before layer 1 was computed
    write_layer(a, slot, 1, 8)
    write_layer(a, slot, 2, 9)
    assert len(sent(a)) == 3
    assert [e.kind for e in a.node.take_events()] == ["ready"]
    deliver(a, b)
    assert [(e.kind, e.hashes) for e in b.node.take_events()] == [("ready", [h(1)])]
    (got,) = b.control(Pin(owner="d1", hashes=[h(1)])).slots
    assert bytes(pool(b).slots.layer(got, 2)) == bytes([9]) * GEOMETRY.layer_bytes
    assert b.stats().blocks_received == 1
    out = a.stats()
    assert out.peer_layers_out == {"b": 3} and out.peer_bytes_out == {"b": out.bytes_out}  # counted by the node sent to


def test_a_corrupted_layer_is_detected_and_the_block_never_shows(tmp_path):
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    a.node.faults.corrupt_next = 1
    slot = a.control(Reserve(owner="r1", hashes=[h(2)], dest="b")).slots[0]
    for layer in range(3):
        write_layer(a, slot, layer, 1)
    deliver(a, b)
    assert [e.kind for e in b.node.take_events()] == ["failed"]
    assert b.control(Pin(owner="d", hashes=[h(2)])).slots == []
    assert b.stats().checksum_failures == 1 and a.stats().corrupted_on_purpose == 1


def test_a_block_arriving_at_a_pool_with_no_room_is_reported_failed_at_once(tmp_path):
    # Decode's pool is full of pinned blocks: the engine waiting for the arriving block
    # hears it will not come (and computes it) instead of waiting out kv_wait_s.
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b", slots=1)
    assert b.control(Reserve(owner="busy", hashes=[h(3)])).slots == [0]  # b's only slot, pinned
    slot = a.control(Reserve(owner="r1", hashes=[h(4)], dest="b")).slots[0]
    for layer in range(3):
        write_layer(a, slot, layer, 2)
    deliver(a, b)
    assert [(e.kind, e.hashes) for e in b.node.take_events()] == [("failed", [h(4)])]  # once, not per layer


def test_a_block_already_in_the_pool_is_sent_without_being_written_again(tmp_path):
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    store(a, 5)  # no destination
    assert sent(a) == []
    assert a.control(Reserve(owner="r2", hashes=[h(5)], dest="b")).slots == [-1]  # nothing to write: it is here
    deliver(a, b)
    assert [e.kind for e in b.node.take_events()] == ["ready"]


def test_a_pull_sends_only_the_blocks_the_puller_lacks(tmp_path):
    a = start(tmp_path / "a", "a", slots=4)
    hashes = [h(i) for i in range(3)]
    for i in range(3):
        store(a, i)
    # b holds the first block already: two blocks travel, and b will hold three.
    assert a.send_to("b", hashes, skip=1) == 3
    assert len(sent(a)) == 2 * GEOMETRY.layers
    assert {frame_decoder.decode(header).block_hash for _, header, _ in sent(a)} == set(hashes[1:])
    sent(a).clear()
    assert a.send_to("b", [hashes[0], b"?" * 16, hashes[2]]) == 1  # only the leading run it holds
    assert len(sent(a)) == GEOMETRY.layers


def test_frames_of_another_geometry_are_dropped(tmp_path):
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    b.received(b"not msgpack", memoryview(b"x"))
    slot = a.control(Reserve(owner="r", hashes=[h(6)], dest="b")).slots[0]
    write_layer(a, slot, 0, 1)
    _, header, payload = sent(a)[0]
    b.received(header, memoryview(payload[:-1]))  # wrong length
    frame = frame_decoder.decode(header)
    for other in (msgspec.structs.replace(frame, geometry=msgspec.structs.replace(GEOMETRY, layout="y")),
                  msgspec.structs.replace(frame, model="another model"),
                  msgspec.structs.replace(frame, v=frame.v + 1)):
        b.received(control_encoder.encode(other), memoryview(payload))
    assert b.node.take_events() == [] and b.stats().layers_in == 0
    b.received(header, memoryview(payload))  # the frame itself is fine
    assert b.stats().layers_in == 1


# --- the pool before and after the first engine attaches ------------------------------
def test_the_pool_file_exists_from_start_up_and_holds_nothing_until_an_engine_attaches(tmp_path):
    a, b = start(tmp_path / "a", "a", attach=False), start(tmp_path / "b", "b")
    assert pool_path(str(tmp_path / "a" / "kv"), "a").stat().st_size == 2 * GEOMETRY.slot_bytes
    for call in (Reserve(owner="r", hashes=[h(1)]), Pin(owner="r", hashes=[h(1)]), Snapshot()):
        reply = a.control(call)
        assert not reply.ok and "attached" in reply.error
    a.note(Written(pool_id="", layer=0, slots=[0], hashes=[h(1)], checksums=[0]))  # dropped, not a crash
    slot = b.control(Reserve(owner="r", hashes=[h(1)], dest="a")).slots[0]
    write_layer(b, slot, 0, 1)
    deliver(b, a)  # dropped: no slots to receive into
    assert a.send_to("b", [h(1)]) == 0
    assert (a.snapshot().dram, a.stats().pool_slots, a.node.take_events()) == ([], 0, [])
    reply = a.control(HELLO)
    assert reply.ok and reply.pool_slots == 2 and reply.pool_id
    assert a.stats().pool_slots == 2


def test_an_engine_of_another_geometry_or_model_is_refused(tmp_path):
    a = start(tmp_path, "a")
    other = Geometry(layers=2, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")
    assert "not m blocks" in a.control(Hello(geometry=other, model="m")).error
    assert "not x blocks" in a.control(Hello(geometry=GEOMETRY, model="x")).error
    assert a.control(HELLO).pool_id == pool(a).pool_id  # a second worker of the same model joins


def test_a_pool_too_small_for_the_engines_blocks_refuses_it_and_stays_unattached(tmp_path):
    a = start(tmp_path, "a", slots=1, attach=False)
    big = Geometry(layers=6, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")
    reply = a.control(Hello(geometry=big, model="m"))
    assert not reply.ok and "holds no block" in reply.error
    assert a.control(HELLO).ok  # a smaller geometry still fits


def test_a_late_note_for_a_slot_that_went_to_another_block_is_dropped_and_counted(tmp_path):
    # Block 1's writer went silent; its slot is reclaimed for block 2. Its note, late,
    # must not mark block 2's layer as written.
    a = start(tmp_path, "a", slots=1)
    (slot,) = a.control(Reserve(owner="r1", hashes=[h(1)])).slots
    pool(a).blocks.fill_timeout_s = 0.0
    assert a.control(Reserve(owner="r2", hashes=[h(2)])).slots == [slot]
    a.note(Written(pool_id=pool(a).pool_id, layer=0, slots=[slot], hashes=[h(1)], checksums=[1]))
    assert pool(a).blocks.slots[slot].checksums == {} and a.security().stale_notes == 1
    write_layer(a, slot, 0, 2)  # block 2's own note counts
    assert list(pool(a).blocks.slots[slot].checksums) == [0] and a.security().stale_notes == 1


def test_a_quiet_peer_has_its_socket_closed_and_a_moved_one_its_old_socket(tmp_path):
    m = start(tmp_path, "n", transport=Recorder("tcp://n"))
    node, transport = m.node, m.node.transport
    node.peers = {}
    assert node.meet("b", "tcp://b:1", now=0.0) and node.meet("c", "tcp://c:1", now=0.0)
    assert not node.meet("b", "tcp://b:1", now=50.0)  # b beats on; c went quiet
    assert node.forget_quiet(now=70.0, after_s=60.0) == ["c"]
    assert node.peers == {"b": "tcp://b:1"} and transport.closed == ["tcp://c:1"]
    assert node.meet("b", "tcp://b:2", now=71.0)  # b restarted on another port
    assert transport.closed == ["tcp://c:1", "tcp://b:1"] and m.upkeep_stats().peers_closed == 2
    assert node.meet("c", "tcp://c:1", now=72.0)  # a heartbeat brings c back
    m.upkeep(now=72.0)  # upkeep uses the messenger's own forget time (60 s): both stay
    assert set(node.peers) == {"b", "c"}


def test_a_layer_written_in_place_is_checked_there_and_never_placed_again(tmp_path):
    # One-sided transports (a sealed ZeroMQ batch opened into the slot, a Transfer
    # Engine write) ask `place` first: a layer already in and checked must not be
    # written over, or a replayed or forged write could change a checked layer.
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    store_for(a, 6, "b")
    (_, header, payload), *rest = sent(a)
    target = b.place(header)
    assert target is not None and len(target) == GEOMETRY.layer_bytes
    target[:] = payload
    b.received(header, None)
    assert b.stats().layers_in == 1 and b.place(header) is None
    for _, later, data in rest:
        b.place(later)[:] = data
        b.received(later, None)
    assert [(e.kind, e.hashes) for e in b.node.take_events()] == [("ready", [h(6)])]


def test_a_layer_written_in_place_with_other_bytes_fails_its_block(tmp_path):
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    store_for(a, 7, "b")
    _, header, payload = sent(a)[0]
    b.place(header)[:] = bytes(len(payload))  # not what was summed
    b.received(header, None)
    assert [e.kind for e in b.node.take_events()] == ["failed"] and b.stats().checksum_failures == 1


def test_a_layer_placed_then_given_up_on_before_it_is_handed_over_is_not_counted(tmp_path):
    # `received` takes the slot `place` just gave without a second look-up: only while
    # that slot still holds the same filling block.
    a, b = start(tmp_path / "a", "a"), start(tmp_path / "b", "b")
    store_for(a, 8, "b")
    _, header, payload = sent(a)[0]
    b.place(header)[:] = payload
    slot = pool(b).blocks.get(h(8))
    pool(b).blocks.drop(slot)  # its slot freed meanwhile (reclaimed, say)
    b.received(header, None)
    assert b.stats().layers_in == 0 and pool(b).blocks.get(h(8)) is None


def store_for(m, i: int, dest: str) -> None:
    """Block i written on `m` (every layer byte i) for `dest`."""
    slot = m.control(Reserve(owner=f"r{i}", hashes=[h(i)], dest=dest)).slots[0]
    for layer in range(GEOMETRY.layers):
        write_layer(m, slot, layer, i)
