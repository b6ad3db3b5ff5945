"""Bookkeeping of a node's block pool: which slot holds which block, how far it has
arrived, who pins it, and which slot to reuse next. Pure logic, no I/O: the
messenger app moves the bytes and calls in here.

A slot is FREE, FILLING (layers arriving) or READY (every layer arrived with a good
checksum). Only READY blocks are visible: lookups, pins and events never see a
torn block. Pinned blocks are never reused; among the rest, the least recently used
ready block goes first, and a FILLING slot whose writer went silent is reclaimed
after `fill_timeout_s`.

Pins an engine asked for are leases (`Leases`): they lapse `lease_s` after their
owner was last renewed, and all of an engine's go when it says it is gone, so an
engine that crashed mid-request cannot leave the pool full of pinned slots. Time is
always passed in (`now`): the pool never reads a clock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from shared.kv.wire import NO_ROOM, NOT_NEEDED

EVICTION_POLICIES = ("lru", "lfu")


class State(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    READY = "ready"


@dataclass
class Slot:
    index: int
    state: State = State.FREE
    block_hash: bytes = b""
    checksums: dict[int, int] = field(default_factory=dict)  # layers in, checksum verified
    owners: set[str] = field(default_factory=set)  # pins
    dests: set[str] = field(default_factory=set)  # nodes that want this block
    since: float = 0.0  # when it started filling
    uses: int = 0  # pins so far (LFU)
    from_ssd: bool = False  # read back from SSD, not served yet: its first use counts as an SSD hit


Arrival = Literal["partial", "ready", "failed", "ignored"]
DEFAULT_LEASE_S = 30.0


class Leases:
    """Until when each owner's pins hold, and which engine holds them. Owners are
    renewed together by their engine's notes; one not renewed in `lease_s` lapses."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self.until: dict[str, float] = {}  # owner → when its pins lapse
        self.engine_of: dict[str, str] = {}  # owner → the engine that asked for its pins

    def __len__(self) -> int:
        return len(self.until)

    def hold(self, owner: str, engine: str, now: float) -> None:
        self.until[owner] = now + self.lease_s
        self.engine_of[owner] = engine

    def renew(self, engine: str, owners: list[str], now: float) -> None:
        """Only owners held for this engine: a renewal never creates a lease (an owner
        already released or lapsed stays so), nor takes another engine's."""
        for owner in owners:
            if owner in self.until and self.engine_of[owner] == engine:
                self.until[owner] = now + self.lease_s

    def lapsed(self, now: float) -> list[str]:
        """Owners whose lease ran out, forgotten here."""
        out = [owner for owner, until in self.until.items() if until <= now]
        for owner in out:
            self.drop(owner)
        return out

    def of_engine(self, engine: str) -> list[str]:
        """Every owner `engine` holds, forgotten here."""
        out = [owner for owner, e in self.engine_of.items() if e == engine]
        for owner in out:
            self.drop(owner)
        return out

    def drop(self, owner: str) -> None:
        self.until.pop(owner, None)
        self.engine_of.pop(owner, None)


class BlockPool:
    def __init__(self, slots: int, layers: int, fill_timeout_s: float = 30.0, eviction: str = "lru",
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        self.eviction = eviction
        self.slots = [Slot(i) for i in range(slots)]
        self.layers = layers
        self.fill_timeout_s = fill_timeout_s
        self.by_hash: dict[bytes, Slot] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # ready slots, oldest first
        self.free = list(range(slots - 1, -1, -1))
        self.owned: dict[str, set[int]] = {}
        self.evicted: list[tuple[bytes, int]] = []  # (hash, slot) of ready blocks reused since take_evicted()
        self.leases = Leases(lease_s)

    # --- lookups -------------------------------------------------------------------
    def get(self, block_hash: bytes) -> Slot | None:
        return self.by_hash.get(block_hash)

    def ready_hashes(self) -> list[bytes]:
        return [self.slots[i].block_hash for i in self.lru]

    def counts(self) -> dict[str, int]:
        filling = sum(1 for s in self.by_hash.values() if s.state is State.FILLING)
        pinned = sum(1 for s in self.slots if s.owners)
        return {"pool_slots": len(self.slots), "ready": len(self.lru), "filling": filling, "pinned": pinned}

    # --- writers -------------------------------------------------------------------
    def reserve(self, block_hash: bytes, owner: str, now: float) -> tuple[int, Slot | None]:
        """A slot to write `block_hash` into, pinned for `owner`. Returns NOT_NEEDED
        with the existing slot when the block is already here or arriving, NO_ROOM
        when every slot is pinned."""
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self._pin(slot, owner)
            return NOT_NEEDED, slot
        slot = self._allocate(block_hash, now)
        if slot is None:
            return NO_ROOM, None
        self._pin(slot, owner)
        return slot.index, slot

    def begin_receive(self, block_hash: bytes, now: float) -> Slot | None:
        """The slot a block arriving from another node goes to; None when it is
        already complete here or there is no room."""
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            return slot if slot.state is State.FILLING else None
        return self._allocate(block_hash, now)

    def layer_arrived(self, slot: Slot, layer: int, checksum: int, good: bool) -> Arrival:
        """Record one layer. A bad checksum drops the whole block."""
        if slot.state is not State.FILLING or not 0 <= layer < self.layers:
            return "ignored"
        if not good:
            self.drop(slot)
            return "failed"
        slot.checksums[layer] = checksum
        if len(slot.checksums) < self.layers:
            return "partial"
        slot.state = State.READY
        self.lru[slot.index] = None
        return "ready"

    def drop(self, slot: Slot) -> None:
        """Forget a block and free its slot (pins included: its readers must recompute)."""
        if self.by_hash.get(slot.block_hash) is slot:
            del self.by_hash[slot.block_hash]
        self.lru.pop(slot.index, None)
        for owner in slot.owners:
            self.owned.get(owner, set()).discard(slot.index)
        index = slot.index
        self.slots[index] = Slot(index)
        self.free.append(index)

    # --- readers -------------------------------------------------------------------
    def pin_one(self, owner: str, block_hash: bytes) -> int | None:
        """Pin a ready block for `owner` (a reader); its slot, or None if it is not ready here."""
        slot = self.by_hash.get(block_hash)
        if slot is None or slot.state is not State.READY:
            return None
        self._pin(slot, owner)
        slot.uses += 1
        self.lru.move_to_end(slot.index)
        return slot.index

    def unpin(self, owner: str) -> None:
        self.leases.drop(owner)
        for index in self.owned.pop(owner, set()):
            self.slots[index].owners.discard(owner)

    # --- leases --------------------------------------------------------------------
    def lease(self, owner: str, engine: str, now: float) -> None:
        """`owner`'s pins (if it holds any) lapse unless renewed within the lease."""
        if owner in self.owned:
            self.leases.hold(owner, engine, now)

    def renew(self, engine: str, owners: list[str], now: float) -> None:
        self.leases.renew(engine, owners, now)

    def expire(self, now: float) -> list[str]:
        """Release the pins of every owner whose lease lapsed; returns those owners."""
        lapsed = self.leases.lapsed(now)
        for owner in lapsed:
            self.unpin(owner)
        return lapsed

    def engine_gone(self, engine: str) -> list[str]:
        """Release every pin `engine` held; returns their owners."""
        owners = self.leases.of_engine(engine)
        for owner in owners:
            self.unpin(owner)
        return owners

    def take_evicted(self) -> list[tuple[bytes, int]]:
        """Blocks evicted since the last call, with the slot that held them: the slot's
        bytes stay intact until its new owner writes, so they can still be spilled."""
        out, self.evicted = self.evicted, []
        return out

    # --- internals -----------------------------------------------------------------
    def _pin(self, slot: Slot, owner: str) -> None:
        slot.owners.add(owner)
        self.owned.setdefault(owner, set()).add(slot.index)

    def _allocate(self, block_hash: bytes, now: float) -> Slot | None:
        index = self._victim(now)
        if index is None:
            return None
        slot = self.slots[index] = Slot(index, State.FILLING, block_hash, since=now)
        self.by_hash[block_hash] = slot
        return slot

    def _victim(self, now: float) -> int | None:
        if self.free:
            return self.free.pop()
        # lru: the first unpinned in the OrderedDict's order; lfu: fewest uses, ties to
        # the least recent.
        unpinned = (i for i in self.lru if not self.slots[i].owners)
        if self.eviction == "lru":
            index = next(unpinned, None)
        else:
            index = min(unpinned, key=lambda i: self.slots[i].uses, default=None)
        if index is not None:
            self.evicted.append((self.slots[index].block_hash, index))
            self.drop(self.slots[index])
            return self.free.pop()
        for slot in list(self.by_hash.values()):
            if slot.state is State.FILLING and now - slot.since > self.fill_timeout_s:
                self.drop(slot)
                return self.free.pop()
        return None
