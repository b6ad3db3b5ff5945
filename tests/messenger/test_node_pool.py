"""A node pool under pressure: eviction order, pins, the SSD tier (spill, promotion,
restart, damaged files). Real pool and SSD files in a temp folder; no transport."""

from __future__ import annotations

import threading

from shared.kv.wire import Pin, Release, Reserve, Snapshot
from tests.messenger.nodes import GEOMETRY, content, h, pool, start, store


def kinds(m) -> list[tuple[str, str, list[str]]]:
    return [(e.kind, e.tier, e.hashes) for e in m.node.take_kv_events()]


def test_lru_evicts_the_least_recently_used_and_reports_it(tmp_path):
    m = start(tmp_path)
    store(m, 1)
    store(m, 2)
    m.control(Pin(owner="r", hashes=[h(1)]))  # block 1 used again: block 2 is older now
    m.note(Release(owner="r"))
    m.node.take_kv_events()
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
    pool(m).ssd.flush()
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
    pool(again).ssd.flush()  # the file goes on the tier's writer thread
    assert not damaged.exists() and again.stats().ssd_dropped == 1
    assert ("removed", "ssd", [h(2).hex()]) in kinds(again)


def test_the_ssd_tier_keeps_within_its_size(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=2 * GEOMETRY.slot_bytes)
    for i in range(1, 7):
        store(m, i)  # 4 spills into a 2-block tier
    pool(m).ssd.flush()
    assert len(list((tmp_path / "ssd").glob("*.blk"))) == 2
    assert m.stats().ssd_blocks == 2


def test_a_spill_leaves_the_event_loop_and_is_served_while_its_write_is_queued(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    store(m, 1)
    store(m, 2)
    disk = threading.Event()
    pool(m).ssd._writer.submit(disk.wait)  # the disk is slow: nothing gets written yet
    store(m, 3)  # evicts block 1: its DRAM slot now holds block 3
    assert not (tmp_path / "ssd" / f"{h(1).hex()}.blk").exists()
    (slot,) = m.control(Pin(owner="r", hashes=[h(1)])).slots  # served from the spill's own copy
    assert content(m, slot) == {1}
    disk.set()
    pool(m).ssd.flush()
    assert (tmp_path / "ssd" / f"{h(1).hex()}.blk").exists() and not pool(m).ssd.pending
