"""The messenger service's loops around the pool: reads back from SSD leave the
event loop; the Hello that carves the pool freezes the heap, in a messenger's own
process only. Real pool and SSD files in a temp folder; no sockets. And its flags:
no KV key, no start (unless --kv-insecure)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from services.messenger.app import MessengerService, cluster_keys, parser
from services.messenger.messenger import Messenger
from shared.kv.keys import KEY_FILE_ENV, write_keys
from shared.kv.wire import Pin, Release
from tests.messenger.nodes import GEOMETRY, HELLO, content, h, pool, start, store


def block_1_on_ssd(tmp_path) -> Messenger:
    """DRAM holds blocks 2 (least recent) and 3; block 1 went to SSD."""
    m = start(tmp_path, ssd_path=str(tmp_path / "ssd"), ssd_bytes=10 * GEOMETRY.slot_bytes)
    for i in (1, 2, 3):
        store(m, i)
    pool(m).ssd.flush()
    return m


def slow_disk(m: Messenger) -> tuple[threading.Event, list[bytes]]:
    """SSD reads wait until the event is set; the list records what was read."""
    ssd = pool(m).ssd
    disk, real_load, loads = threading.Event(), ssd.load, []

    def slow_load(block_hash, slot):
        loads.append(block_hash)
        assert disk.wait(5)
        return real_load(block_hash, slot)

    ssd.load = slow_load
    return disk, loads


async def test_a_read_back_from_ssd_leaves_the_event_loop_and_hides_the_block_until_verified(tmp_path):
    m = block_1_on_ssd(tmp_path)
    disk, _ = slow_disk(m)
    reading = asyncio.create_task(MessengerService(m, sockets=None)._read_from_ssd("r", [h(1)]))
    await asyncio.sleep(0.05)
    assert not reading.done()  # the loop ran on while the disk worked
    assert h(1) not in pool(m).blocks.ready_hashes()  # its slot is filling: nobody sees a torn block
    disk.set()
    await reading
    (slot,) = m.control(Pin(owner="r", hashes=[h(1)])).slots  # already in DRAM: no inline read
    assert content(m, slot) == {1}
    stats = m.stats()
    assert (stats.hits_ssd, stats.hits_dram) == (1, 0)


async def test_making_room_for_a_read_back_keeps_the_blocks_the_same_pin_takes(tmp_path):
    m = block_1_on_ssd(tmp_path)
    await MessengerService(m, sockets=None)._read_from_ssd("r", [h(2), h(1)])
    slots = m.control(Pin(owner="r", hashes=[h(2), h(1)])).slots  # 3 made room, not 2
    assert [content(m, s) for s in slots] == [{2}, {1}]
    stats = m.stats()  # 2 stayed in DRAM: not spilled and read back again
    assert (stats.hits_dram, stats.hits_ssd, stats.evictions) == (1, 1, 2)
    m.note(Release(owner="r"))
    assert not any(s.owners for s in pool(m).blocks.slots)  # the request's release frees the run


async def test_a_pin_waits_for_the_read_back_another_pin_started(tmp_path):
    m = block_1_on_ssd(tmp_path)
    disk, loads = slow_disk(m)
    service = MessengerService(m, sockets=None)
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


# --- the heap: frozen once, when the pool is carved, in the messenger's own process --
@pytest.mark.parametrize("owns_process", [True, False])
def test_the_hello_that_carves_the_pool_freezes_the_heap_once_and_only_in_the_messengers_process(
        tmp_path, monkeypatch, owns_process):
    frozen = []
    monkeypatch.setattr("services.messenger.app.freeze_heap", lambda: frozen.append(True))
    service = MessengerService(start(tmp_path, attach=False), sockets=None, owns_process=owns_process)
    assert service.answer(HELLO).ok and service.answer(HELLO).ok  # an engine, then another
    assert frozen == ([True] if owns_process else [])


# --- the KV key: required unless the messenger is told to run without one ------------
def test_a_messenger_without_a_kv_key_refuses_to_start_unless_told_insecure(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    base = ["--instance-id", "m", "--config", "c.json"]
    with pytest.raises(SystemExit, match="--kv-key-file"):
        cluster_keys(parser().parse_args(base))
    assert cluster_keys(parser().parse_args([*base, "--kv-insecure"])) is None
    keys = write_keys(tmp_path / "kv.key")
    assert cluster_keys(parser().parse_args([*base, "--kv-key-file", str(tmp_path / "kv.key")])) == keys
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "kv.key"))
    args = parser().parse_args(base)
    assert cluster_keys(args) == keys and not args.fault_injection  # off unless asked for
    os.chmod(tmp_path / "kv.key", 0o644)
    with pytest.raises(SystemExit, match="open to others"):
        cluster_keys(args)
