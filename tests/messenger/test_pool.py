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


# --- leases: a pin lasts only while its engine renews it --------------------------
def leased(lease_s: float = 10.0) -> BlockPool:
    """A pool whose block 1 is pinned by request "r" of engine "e", leased at t=0."""
    pool = BlockPool(slots=2, layers=1, lease_s=lease_s)
    fill(pool, 1)
    pool.unpin("w")
    pool.pin_one("r", h(1))
    pool.lease("r", "e", now=0.0)
    return pool


def test_a_pin_whose_lease_is_not_renewed_is_released_when_it_lapses():
    pool = leased(lease_s=10.0)
    assert pool.expire(now=9.9) == [] and pool.counts()["pinned"] == 1
    assert pool.expire(now=10.0) == ["r"]
    assert pool.counts()["pinned"] == 0 and "r" not in pool.owned
    assert pool.expire(now=100.0) == []  # forgotten: lapses once
    fill(pool, 2)
    fill(pool, 3)  # block 1's slot may be reused now
    assert pool.get(h(1)) is None


def test_renewals_keep_a_pin_and_only_its_own_engine_renews_it():
    pool = leased(lease_s=10.0)
    for now in (8.0, 16.0, 24.0):
        pool.renew("e", ["r", "never-pinned"], now)
        assert pool.expire(now + 9.0) == []
    pool.renew("other-engine", ["r"], 30.0)  # not its engine: no effect
    assert pool.expire(now=34.0) == ["r"]
    assert len(pool.leases) == 0  # a renewal never created a lease for "never-pinned"


def test_an_engine_that_is_gone_loses_every_pin_at_once():
    pool = leased()
    pool.pin_one("r2", h(1))
    pool.lease("r2", "e", now=0.0)
    pool.pin_one("mine", h(1))
    pool.lease("mine", "f", now=0.0)
    assert sorted(pool.engine_gone("e")) == ["r", "r2"]
    assert pool.slots[pool.get(h(1)).index].owners == {"mine"}
    assert pool.engine_gone("e") == []


def test_a_released_pin_drops_its_lease_and_an_owner_without_pins_gets_none():
    pool = leased()
    pool.unpin("r")
    assert len(pool.leases) == 0
    pool.lease("nobody", "e", now=0.0)  # holds no pin: nothing to lease
    assert len(pool.leases) == 0
    assert pool.expire(now=1e9) == []
