"""A node pool under pressure: eviction order, pins, the SSD tier (spill, promotion,
restart, damaged files). Real pool and SSD files in a temp folder; no transport."""

from __future__ import annotations

from services.messenger.messenger import Messenger, PoolOptions
from shared.kv_pool import Geometry, checksum
from shared.kv_wire import Hello, Pin, Release, Reserve, Snapshot, Written

GEOMETRY = Geometry(layers=2, shape=(1, 8, 8), dtype="uint8", itemsize=1, layout="x")


class NoTransport:
    endpoint = "tcp://nowhere"

    def connect(self, endpoint: str) -> None: ...

    def send(self, endpoint, header, payload) -> bool:
        return True


def h(i: int) -> bytes:
    return bytes([i]) * 16


def start(tmp_path, slots: int = 2, **pool) -> Messenger:
    m = Messenger("n", str(tmp_path / "kv"), PoolOptions(pool_bytes=slots * GEOMETRY.slot_bytes, **pool), NoTransport())
    assert m.control(Hello(geometry=GEOMETRY, model="m")).ok
    return m


def store(m: Messenger, i: int) -> None:
    """A prefill writes block i (every layer filled with byte i) and finishes."""
    (slot,) = m.control(Reserve(owner=f"w{i}", hashes=[h(i)])).slots
    assert slot >= 0
    for layer in range(GEOMETRY.layers):
        part = m.file.layer(slot, layer)
        part[:] = bytes([i]) * len(part)
        m.written(Written(pool_id=m.pool_id, layer=layer, slots=[slot], checksums=[checksum(part)]))
    m.note(Release(owner=f"w{i}"))


def content(m: Messenger, slot: int) -> set[int]:
    return {b for layer in range(GEOMETRY.layers) for b in bytes(m.file.layer(slot, layer))}


def kinds(m: Messenger) -> list[tuple[str, str, list[str]]]:
    return [(e.kind, e.tier, e.hashes) for e in m.take_kv_events()]


def test_lru_evicts_the_least_recently_used_and_reports_it(tmp_path):
    m = start(tmp_path)
    store(m, 1)
    store(m, 2)
    m.control(Pin(owner="r", hashes=[h(1)]))  # block 1 used again: block 2 is older now
    m.note(Release(owner="r"))
    m.take_kv_events()
    store(m, 3)
    assert ("evicted", "dram", [h(2).hex()]) in kinds(m)
    assert m.control(Pin(owner="r", hashes=[h(2)])).slots == []
    assert len(m.control(Pin(owner="r", hashes=[h(1)])).slots) == 1


def test_lfu_keeps_the_most_used_block(tmp_path):
    m = start(tmp_path, eviction="lfu")
    store(m, 1)
    store(m, 2)
    for _ in range(3):
        m.control(Pin(owner="r", hashes=[h(1)]))
    m.control(Pin(owner="r2", hashes=[h(2)]))  # block 2 more recent, but used once
    m.note(Release(owner="r"))
    m.note(Release(owner="r2"))
    store(m, 3)
    assert m.stats().evictions == 1
    assert m.control(Pin(owner="x", hashes=[h(1)])).slots and not m.control(Pin(owner="y", hashes=[h(2)])).slots


def test_pinned_blocks_survive_pressure_and_a_full_pool_refuses(tmp_path):
    m = start(tmp_path)
    store(m, 1)
    store(m, 2)
    m.control(Pin(owner="reader", hashes=[h(1), h(2)]))
    reply = m.control(Reserve(owner="w3", hashes=[h(3)]))
    assert reply.slots == [-2]  # no room: this block will be computed, nothing fails
    assert m.stats().evictions == 0
    m.note(Release(owner="reader"))
    assert m.control(Reserve(owner="w3", hashes=[h(3)])).slots[0] >= 0


def test_evicted_blocks_spill_to_ssd_and_come_back_on_a_hit(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    store(m, 1)
    store(m, 2)
    store(m, 3)  # evicts block 1 to SSD
    events = kinds(m)
    assert ("evicted", "dram", [h(1).hex()]) in events and ("stored", "ssd", [h(1).hex()]) in events
    m.ssd.flush()
    assert (tmp_path / "ssd" / f"{h(1).hex()}.blk").exists()
    assert h(1) in m.control(Snapshot()).ready  # engines still see it as available
    (slot,) = m.control(Pin(owner="r", hashes=[h(1)])).slots
    assert content(m, slot) == {1}
    stats = m.stats()
    assert stats.hits_ssd == 1 and stats.spills >= 1
    assert ("stored", "dram", [h(1).hex()]) in kinds(m)


def test_ssd_blocks_are_found_after_a_restart_and_a_damaged_file_is_dropped(tmp_path):
    ssd = dict(ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    m = start(tmp_path, **ssd)
    for i in (1, 2, 3, 4):
        store(m, i)  # blocks 1 and 2 spill
    m.close()
    # Damage block 2's file in its payload: the header still parses, the checksum fails.
    damaged = tmp_path / "ssd" / f"{h(2).hex()}.blk"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))

    again = start(tmp_path, **ssd)
    assert {h(1), h(2)} <= set(again.control(Snapshot()).ready)
    (slot,) = again.control(Pin(owner="r", hashes=[h(1)])).slots
    assert content(again, slot) == {1}
    assert again.control(Pin(owner="r", hashes=[h(2)])).slots == []
    assert not damaged.exists() and again.stats().ssd_dropped == 1
    assert ("removed", "ssd", [h(2).hex()]) in kinds(again)


def test_the_ssd_tier_keeps_within_its_size(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=2 * GEOMETRY.slot_bytes)
    for i in range(1, 7):
        store(m, i)  # 4 spills into a 2-block tier
    m.ssd.flush()
    assert len(list((tmp_path / "ssd").glob("*.blk"))) == 2
    assert m.stats().ssd_blocks == 2


def test_a_spill_leaves_the_event_loop_and_is_served_while_its_write_is_queued(tmp_path):
    import threading

    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    store(m, 1)
    store(m, 2)
    disk = threading.Event()
    m.ssd._writer.submit(disk.wait)  # the disk is slow: nothing gets written yet
    store(m, 3)  # evicts block 1: its DRAM slot now holds block 3
    assert not (tmp_path / "ssd" / f"{h(1).hex()}.blk").exists()
    (slot,) = m.control(Pin(owner="r", hashes=[h(1)])).slots  # served from the spill's own copy
    assert content(m, slot) == {1}
    disk.set()
    m.ssd.flush()
    assert (tmp_path / "ssd" / f"{h(1).hex()}.blk").exists() and not m.ssd.pending


async def test_a_read_back_from_ssd_leaves_the_event_loop_and_hides_the_block_until_verified(tmp_path):
    import asyncio
    import threading

    from services.messenger.app import MessengerService

    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    for i in (1, 2, 3):  # block 1 goes to SSD
        store(m, i)
    m.ssd.flush()
    disk, real_load = threading.Event(), m.ssd.load

    def slow_load(block_hash, slot):  # the disk is slow
        assert disk.wait(5)
        return real_load(block_hash, slot)

    m.ssd.load = slow_load
    reading = asyncio.create_task(MessengerService("n", m, sockets=None)._read_from_ssd("r", [h(1)]))
    await asyncio.sleep(0.05)
    assert not reading.done()  # the loop ran on while the disk worked
    assert h(1) not in m.pool.ready_hashes()  # its slot is filling: nobody sees a torn block
    disk.set()
    await reading
    (slot,) = m.control(Pin(owner="r", hashes=[h(1)])).slots  # already in DRAM: no inline read
    assert content(m, slot) == {1}
    stats = m.stats()
    assert (stats.hits_ssd, stats.hits_dram) == (1, 0)


async def test_making_room_for_a_read_back_keeps_the_blocks_the_same_pin_takes(tmp_path):
    from services.messenger.app import MessengerService

    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    for i in (1, 2, 3):  # DRAM holds 2 (least recent) and 3; block 1 is on SSD
        store(m, i)
    m.ssd.flush()
    await MessengerService("n", m, sockets=None)._read_from_ssd("r", [h(2), h(1)])
    slots = m.control(Pin(owner="r", hashes=[h(2), h(1)])).slots  # 3 made room, not 2
    assert [content(m, s) for s in slots] == [{2}, {1}]
    stats = m.stats()  # 2 stayed in DRAM: not spilled and read back again
    assert (stats.hits_dram, stats.hits_ssd, stats.evictions) == (1, 1, 2)
    m.note(Release(owner="r"))
    assert not any(s.owners for s in m.pool.slots)  # the request's release frees the run


async def test_a_pin_waits_for_the_read_back_another_pin_started(tmp_path):
    import asyncio
    import threading

    from services.messenger.app import MessengerService

    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    for i in (1, 2, 3):  # block 1 goes to SSD
        store(m, i)
    m.ssd.flush()
    disk, real_load, loads = threading.Event(), m.ssd.load, []

    def slow_load(block_hash, slot):
        loads.append(block_hash)
        assert disk.wait(5)
        return real_load(block_hash, slot)

    m.ssd.load = slow_load
    service = MessengerService("n", m, sockets=None)
    first = asyncio.create_task(service._read_from_ssd("a", [h(1)]))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(service._read_from_ssd("b", [h(1)]))  # a send, say, of the same block
    await asyncio.sleep(0.05)
    assert not second.done()  # it waits for the first read rather than find the block filling
    disk.set()
    await asyncio.gather(first, second)
    assert loads == [h(1)]  # read once
    for owner in ("a", "b"):
        (slot,) = m.control(Pin(owner=owner, hashes=[h(1)])).slots
        assert content(m, slot) == {1}
