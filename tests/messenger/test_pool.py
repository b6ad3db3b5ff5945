"""Block pool bookkeeping: visibility only when complete, pins, LRU reuse."""

from __future__ import annotations

from services.messenger.pool import BlockPool, State
from shared.kv.wire import NO_ROOM, NOT_NEEDED


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(pool: BlockPool, i: int, owner: str = "w") -> int:
    index, slot = pool.reserve(h(i), owner, now=0.0)
    assert slot is not None
    for layer in range(pool.layers):
        pool.layer_arrived(slot, layer, checksum=layer, good=True)
    return index


def test_a_block_is_visible_only_when_every_layer_arrived():
    pool = BlockPool(slots=2, layers=3)
    index, slot = pool.reserve(h(1), "w", now=0.0)
    assert index >= 0 and slot.state is State.FILLING
    assert pool.layer_arrived(slot, 0, 10, good=True) == "partial"
    assert pool.layer_arrived(slot, 2, 12, good=True) == "partial"
    assert pool.pin_one("r", h(1)) is None and pool.ready_hashes() == []
    assert pool.layer_arrived(slot, 1, 11, good=True) == "ready"
    assert pool.ready_hashes() == [h(1)]
    assert pool.pin_one("r", h(1)) == index


def test_a_bad_checksum_drops_the_block_and_frees_its_slot():
    pool = BlockPool(slots=1, layers=2)
    _, slot = pool.reserve(h(1), "w", now=0.0)
    assert pool.layer_arrived(slot, 0, 1, good=False) == "failed"
    assert pool.get(h(1)) is None
    index, _ = pool.reserve(h(2), "w2", now=0.0)
    assert index == 0


def test_reserving_a_present_block_says_not_needed():
    pool = BlockPool(slots=2, layers=1)
    fill(pool, 1)
    index, slot = pool.reserve(h(1), "other", now=0.0)
    assert index == NOT_NEEDED and slot is not None and "other" in slot.owners


def test_pinned_blocks_survive_pressure_and_lru_goes_first():
    pool = BlockPool(slots=3, layers=1)
    for i in (1, 2, 3):
        fill(pool, i)
    pool.unpin("w")
    pool.pin_one("reader", h(1))  # block 1 pinned (and most recent)
    pool.pin_one("toucher", h(3))
    pool.unpin("toucher")  # block 3 touched: block 2 is now least recently used
    index, _ = pool.reserve(h(4), "w", now=0.0)
    assert index >= 0
    assert [b for b, _ in pool.take_evicted()] == [h(2)]
    assert pool.get(h(1)) is not None and pool.get(h(3)) is not None


def test_a_pool_full_of_pinned_blocks_refuses_instead_of_evicting():
    pool = BlockPool(slots=2, layers=1)
    fill(pool, 1)
    fill(pool, 2)  # both still pinned by "w"
    assert pool.reserve(h(3), "x", now=0.0) == (NO_ROOM, None)
    pool.unpin("w")
    assert pool.reserve(h(3), "x", now=0.0)[0] >= 0


def test_a_silent_filling_slot_is_reclaimed_after_the_timeout():
    pool = BlockPool(slots=1, layers=2, fill_timeout_s=5.0)
    pool.begin_receive(h(1), now=0.0)  # a sender that died after one layer: no pin
    assert pool.begin_receive(h(2), now=1.0) is None
    slot = pool.begin_receive(h(2), now=10.0)
    assert slot is not None and slot.block_hash == h(2)


def test_receiving_a_block_already_complete_is_ignored():
    pool = BlockPool(slots=2, layers=1)
    fill(pool, 1)
    assert pool.begin_receive(h(1), now=0.0) is None
