"""A node pool under pressure: eviction order, pins, the SSD tier (spill, promotion,
restart, damaged files). Real pool and SSD files in a temp folder; no transport."""

from __future__ import annotations

import threading
import time

from shared.kv.wire import NO_ROOM, Bye, Pin, Release, Renew, Reserve, Snapshot
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


# --- leases over the engines' wire -------------------------------------------------
def test_a_crashed_engines_pins_lapse_and_its_blocks_are_evictable_again(tmp_path):
    """An engine pins both blocks then dies without a Release: the pool refuses new
    blocks until the lease lapses, then takes them."""
    m = start(tmp_path, lease_s=5.0)
    store(m, 1)
    store(m, 2)
    now = time.monotonic()
    reply = m.control(Pin(owner="r", hashes=[h(1), h(2)], engine="e"))
    assert reply.lease_s == 5.0 and len(reply.slots) == 2
    assert m.control(Reserve(owner="w3", hashes=[h(3)])).slots == [NO_ROOM]
    m.upkeep(now + 4.0)
    assert m.stats().pinned == 2  # still within its lease
    m.upkeep(now + 5.5)
    assert m.stats().pinned == 0 and m.upkeep_stats().leases_lapsed == 1
    assert m.control(Reserve(owner="w3", hashes=[h(3)])).slots[0] >= 0


def test_renew_notes_keep_pins_and_bye_releases_them(tmp_path):
    m = start(tmp_path, lease_s=5.0)
    store(m, 1)
    m.control(Pin(owner="r", hashes=[h(1)], engine="e"))
    for _ in range(3):
        m.note(Renew(engine="e", owners=["r"]))  # renewed at about now: lapses after now + 5
    m.upkeep(time.monotonic() + 4.0)
    assert m.stats().pinned == 1
    m.note(Bye(engine="e"))
    assert m.stats().pinned == 0


def test_an_unattached_pool_takes_lease_notes_and_upkeep_quietly(tmp_path):
    m = start(tmp_path, attach=False)
    m.note(Renew(engine="e", owners=["r"]))
    m.note(Bye(engine="e"))
    m.upkeep(time.monotonic())
    assert m.stats().pinned == 0


# --- the SSD writer's queue is bounded ----------------------------------------------
def test_spills_beyond_the_writers_queue_are_skipped_and_counted(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes,
              ssd_queue_bytes=GEOMETRY.slot_bytes)  # one spill waits at most
    ssd = pool(m).ssd
    disk = threading.Event()
    real_write = ssd._write_file
    ssd._write_file = lambda block_hash, data: (disk.wait(5), real_write(block_hash, data))
    for i in (1, 2, 3, 4):  # evicts 1 (queued, the writer stuck on it), then 2 (skipped)
        store(m, i)
    assert ssd.hashes() == [h(1)] and ssd.skipped == 1 and m.upkeep_stats().spills_skipped == 1
    assert ("stored", "ssd", [h(2).hex()]) not in kinds(m)
    assert m.stats().spills == 1
    disk.set()
    ssd.flush()
    assert ssd.queued_bytes == 0
    store(m, 5)  # the queue has room again: 3 goes to SSD
    assert h(3) in ssd


def test_blocks_read_back_for_a_pin_that_never_comes_are_not_pinned_for_ever(tmp_path):
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes, lease_s=5.0)
    for i in (1, 2, 3):
        store(m, i)  # block 1 on SSD only
    pool(m).ssd.flush()
    (read,) = m.ssd_reads("r", [h(1)])  # then the request is cancelled: no Pin, no Release
    read.finish(read.load())
    assert m.stats().pinned == 1
    m.upkeep(time.monotonic() + 6.0)
    assert m.stats().pinned == 0
