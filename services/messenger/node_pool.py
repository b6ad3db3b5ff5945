"""A node's pool, from start-up on: `Unattached` until the first engine's Hello cuts
its file into slots of that engine's block geometry, then a `NodePool`. The
messenger holds one or the other and asks it everything; only `Unattached` knows
that there may be no slots yet, and it answers as a pool that holds nothing.

A `NodePool` answers the engines (hello, reserve, pin, snapshot), takes the
workers' notes (layer written, pins released), streams each written layer to the
messengers that want its block, receives layers from other messengers, spills
evicted blocks to the SSD tier and reads them back, and tells the node's engines
which blocks became ready or failed. Every call is synchronous and quick.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec
import structlog

from services.messenger.node import Node
from services.messenger.pool import DEFAULT_LEASE_S, BlockPool, Slot, State
from services.messenger.ssd import DEFAULT_QUEUE_BYTES, SsdTier
from shared.kv.leading import leading_run
from shared.kv.pool_file import PoolFile, PoolSlots, checksum, model_id
from shared.kv.wire import (
    FAILED_MEMORY_S,
    NO_ROOM,
    NOT_NEEDED,
    WIRE_VERSION,
    Control,
    Hello,
    LayerFrame,
    Pin,
    Renew,
    Reply,
    Reserve,
    Snapshot,
    Written,
    control_encoder,
)

log = structlog.get_logger(__name__)
SsdFound = list[int] | None | Exception  # what reading a block back from SSD found


@dataclass(frozen=True)
class PoolOptions:
    pool_bytes: int
    eviction: str = "lru"
    ssd_path: str = ""  # empty: no SSD tier
    ssd_bytes: int = 0
    stream_layers: bool = True
    lease_s: float = DEFAULT_LEASE_S  # an engine's pins lapse this long after its last renewal
    ssd_queue_bytes: int = DEFAULT_QUEUE_BYTES  # spills waiting for the disk, at most


@dataclass(frozen=True)
class SsdRead:
    """A block only the SSD tier holds, given a DRAM slot to be read into (FILLING:
    invisible until verified). `load` runs on a thread; `finish` back on the loop."""

    pool: NodePool
    block_hash: bytes
    slot: Slot

    def load(self) -> SsdFound:
        return self.pool.ssd_load(self)

    def finish(self, found: SsdFound) -> bool:
        return self.pool.ssd_read_done(self, found)


class Unattached:
    """The node pool before any engine said hello: its file (pool_bytes of shared
    memory, created at start-up), not yet cut into slots. It holds nothing, so
    every question has the answer "nothing here"."""

    pool_id = ""  # no pool to follow yet: engines resynchronise when one is carved

    def __init__(self, file: PoolFile, options: PoolOptions, node: Node) -> None:
        self.file = file
        self.options = options
        self.node = node

    def attach(self, hello: Hello) -> NodePool:
        """Cut the file into slots of this engine's geometry (ValueError if none fits)."""
        return NodePool(self.file, hello, self.options, self.node)

    def control(self, message: Control) -> Reply:
        return Reply(ok=False, error="no engine has attached this node's pool yet")

    def release(self, owner: str) -> None:
        pass

    def renew(self, r: Renew) -> None:
        pass

    def engine_gone(self, engine: str) -> None:
        pass

    def expire(self, now: float) -> None:
        pass

    def written(self, w: Written) -> None:
        log.warning("written note for another pool dropped", pool_id=w.pool_id)

    def received(self, frame: LayerFrame, payload: memoryview | None) -> None:
        log.warning("transfer frame before any engine attached dropped", model=frame.model)

    def place(self, frame: LayerFrame) -> memoryview | None:
        return None

    def ssd_reads(self, owner: str, hashes: list[bytes]) -> list[SsdRead]:
        return []

    def send_to(self, dest: str, hashes: list[bytes], skip: int = 0, owner: str = "") -> int:
        return 0

    def held(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def gauges(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        remove(self.file)


def remove(file: PoolFile) -> None:
    file.close()
    try:
        os.unlink(file.path)
    except OSError:
        pass


class NodePool:
    """The node pool, cut into slots of one geometry: every block here is `model`'s."""

    def __init__(self, file: PoolFile, hello: Hello, options: PoolOptions, node: Node) -> None:
        self.slots = PoolSlots(file, hello.geometry)
        self.model = hello.model
        self.model_id = model_id(hello.model)
        self.options = options
        self.node = node
        self.pool_id = uuid.uuid4().hex[:12]
        self.blocks = BlockPool(self.slots.count, hello.geometry.layers, eviction=options.eviction,
                                lease_s=options.lease_s)
        self.ssd: SsdTier | None = None
        if options.ssd_path:
            self.ssd = SsdTier(Path(options.ssd_path), options.ssd_bytes, hello.geometry, self.model_id,
                               queue_bytes=options.ssd_queue_bytes)
            node.kv_event("stored", "ssd", self.ssd.hashes())
        self._failed: dict[bytes, float] = {}  # blocks given up on, and when
        self._placed: tuple[LayerFrame | None, Slot] = (None, Slot(-1))  # the last layer placed, see _placed_slot
        log.info("pool carved", path=str(file.path), slots=self.slots.count, block_bytes=hello.geometry.slot_bytes,
                 geometry=msgspec.structs.asdict(hello.geometry), model=hello.model, pool_id=self.pool_id)

    def attach(self, hello: Hello) -> NodePool:
        return self  # carved already: `control` checks the engine's geometry matches

    # --- engines (control socket) ------------------------------------------------
    def control(self, message: Control) -> Reply:
        if isinstance(message, Hello):
            return self._hello(message)
        lease_s = self.options.lease_s
        if isinstance(message, Reserve):
            slots = self._reserve(message)
            self.blocks.lease(message.owner, message.engine, time.monotonic())
            return Reply(pool_id=self.pool_id, slots=slots, lease_s=lease_s)
        if isinstance(message, Pin):
            slots = self._pin(message.owner, message.hashes)
            self.blocks.lease(message.owner, message.engine, time.monotonic())
            return Reply(pool_id=self.pool_id, slots=slots, lease_s=lease_s)
        if isinstance(message, Snapshot):
            dram, ssd = self.held()
            return Reply(pool_id=self.pool_id, ready=dram + [h for h in ssd if h not in self.blocks.by_hash])
        return Reply(ok=False, error=f"unknown call {type(message).__name__}")

    def _hello(self, hello: Hello) -> Reply:
        if hello.geometry != self.slots.geometry or hello.model != self.model:
            return Reply(ok=False, error=f"this node's pool holds {self.model} blocks of {self.slots.geometry}, "
                                         f"not {hello.model} blocks of {hello.geometry}")
        return Reply(pool_id=self.pool_id, pool_path=str(self.slots.file.path), pool_slots=self.slots.count,
                     lease_s=self.options.lease_s)

    def _reserve(self, r: Reserve) -> list[int]:
        now = time.monotonic()
        dest = r.dest if r.dest and r.dest != self.node.name else ""
        slots = []
        for h in r.hashes:
            if self.node.faults.no_room_next > 0:
                self.node.faults.no_room_next -= 1
                slots.append(NO_ROOM)
                continue
            index, slot = self.blocks.reserve(h, r.owner, now)
            slots.append(index)
            if slot is not None and dest:
                self._want(slot, dest)
        self._spill_evicted()
        if NO_ROOM in slots:
            log.warning("pool full of pinned blocks", request_id=r.owner, refused=slots.count(NO_ROOM))
        return slots

    def _pin(self, owner: str, hashes: list[bytes]) -> list[int]:
        """Pin the leading run of `hashes` held here, promoting SSD blocks to DRAM."""
        slots: list[int] = []
        if leading_run(hashes, partial(self._pin_one, owner, slots)) < len(hashes):
            self.node.counters.misses += 1
        return slots

    def _pin_one(self, owner: str, slots: list[int], block_hash: bytes) -> bool:
        index = self.blocks.pin_one(owner, block_hash)
        if index is None and self._promote(owner, block_hash) is not None:
            index = self.blocks.pin_one(owner, block_hash)
        if index is None:
            return False
        self._count_hit(self.blocks.slots[index])
        slots.append(index)
        return True

    def _count_hit(self, slot: Slot) -> None:
        """A block served (pinned, or sent to a puller): from DRAM, or read back from SSD for it."""
        if slot.from_ssd:
            slot.from_ssd = False
            self.node.counters.hits_ssd += 1
        else:
            self.node.counters.hits_dram += 1

    # --- SSD reads: a block coming back from disk arrives like one from the network --
    def ssd_reads(self, owner: str, hashes: list[bytes]) -> list[SsdRead]:
        """The leading blocks of `hashes` that only the SSD tier holds, each given a
        DRAM slot to be read into. app.py reads them on a thread before the pin or
        the send that needs them, so a disk read never stalls the event loop;
        `_promote` does the same inline. Every block of the run, here or read back,
        is pinned for `owner` meanwhile: making room for one must not evict another
        the same pin is about to take."""
        reads: list[SsdRead] = []
        if self.ssd is not None:
            leading_run(hashes, partial(self._claim_read, owner, reads))
            # A read whose pin or send never comes (cancelled) must not pin for ever;
            # a Pin's own lease, under its engine, replaces this one.
            self.blocks.lease(owner, "", time.monotonic())
        return reads

    def _claim_read(self, owner: str, reads: list[SsdRead], block_hash: bytes) -> bool:
        assert self.ssd is not None
        if self.blocks.get(block_hash) is None and block_hash not in self.ssd:
            return False
        index, slot = self.blocks.reserve(block_hash, owner, time.monotonic())  # pins it; a new slot is FILLING
        self._spill_evicted()
        if slot is None:  # every slot pinned
            return False
        if index != NOT_NEEDED:
            reads.append(SsdRead(self, block_hash, slot))
        return True

    def ssd_load(self, read: SsdRead) -> SsdFound:
        """Disk into the slot, verified (thread-safe): the layer checksums, None when
        the file is gone, or the error that shows it damaged."""
        assert self.ssd is not None
        try:
            return self.ssd.load(read.block_hash, self.slots.slot(read.slot.index))
        except Exception as e:  # whatever went wrong, the block is not served and its slot is freed
            return e

    def ssd_read_done(self, read: SsdRead, found: SsdFound) -> bool:
        """Back on the loop: the block is READY in DRAM, or its slot is freed."""
        assert self.ssd is not None
        slot, block_hash = read.slot, read.block_hash
        sums = self.ssd.settle(block_hash, found)
        if isinstance(found, Exception):
            self.node.kv_event("removed", "ssd", [block_hash])
        ours = slot.block_hash == block_hash and slot.state is State.FILLING  # not reclaimed meanwhile
        if sums is None or not ours:
            if ours:
                self.blocks.drop(slot)
            return False
        for layer, layer_sum in enumerate(sums):
            self._arrived(slot, layer, layer_sum, good=True)
        slot.from_ssd = slot.state is State.READY
        return slot.from_ssd

    def _promote(self, owner: str, block_hash: bytes) -> Slot | None:
        """Bring a block back from SSD into a DRAM slot pinned for `owner`, inline
        (what app.py has not read ahead on a thread)."""
        reads = self.ssd_reads(owner, [block_hash])
        if not reads:
            return None
        (read,) = reads
        return read.slot if read.finish(read.load()) else None

    # --- other messengers ----------------------------------------------------------
    def send_to(self, dest: str, hashes: list[bytes], skip: int = 0, owner: str = "") -> int:
        """Push the leading run of `hashes` held here to `dest` (a pull from there),
        but for the first `skip`, which `dest` holds already; returns how many leading
        blocks `dest` will then have. `owner`: the pins of blocks read back for this
        send (`ssd_reads`), released here."""
        owner = owner or f"send-{dest}"
        skip = max(0, min(skip, len(hashes)))
        sent = skip + leading_run(hashes[skip:], partial(self._send_held, dest, owner))
        self.blocks.unpin(owner)
        return sent

    def _send_held(self, dest: str, owner: str, block_hash: bytes) -> bool:
        slot = self.blocks.get(block_hash) or self._promote(owner, block_hash)
        if slot is None or slot.state is not State.READY:
            return False
        self._count_hit(slot)
        self._send_block(slot, dest)
        return True

    def _want(self, slot: Slot, dest: str) -> None:
        """`dest` wants this block: send what has arrived, and the rest as it arrives."""
        if slot.state is State.READY:
            self._send_block(slot, dest)
            return
        slot.dests.add(dest)
        if self.options.stream_layers:
            for layer in sorted(slot.checksums):
                self._send_layer(slot, layer, dest)

    def _send_block(self, slot: Slot, dest: str) -> None:
        for layer in range(self.blocks.layers):
            self._send_layer(slot, layer, dest)

    def _send_layer(self, slot: Slot, layer: int, dest: str) -> None:
        frame = LayerFrame(block_hash=slot.block_hash, layer=layer, checksum=slot.checksums[layer],
                           geometry=self.slots.geometry, model=self.model)
        self.node.send(dest, control_encoder.encode(frame), self.slots.layer(slot.index, layer))

    def received(self, frame: LayerFrame, payload: memoryview | None) -> None:
        """One layer from another messenger: into the pool, checked, maybe completing a
        block. Payload None: the sender wrote it into the slot `place` gave (one-sided),
        so only the check is left."""
        if payload is None:
            slot = self._placed_slot(frame)
            if slot is not None:
                self._check_in(slot, frame, self.slots.layer(slot.index, frame.layer), copy=False)
            return
        if len(payload) != self.slots.geometry.layer_bytes:
            log.warning("transfer frame for another geometry dropped", model=frame.model)
            return
        slot = self._receiving(frame, allocate=True)
        if slot is not None:
            self._check_in(slot, frame, payload, copy=True)

    def place(self, frame: LayerFrame) -> memoryview | None:
        """The slot part a layer about to be written here by another messenger goes to
        (the block's slot is taken now, FILLING); None when it is not wanted."""
        slot = self._receiving(frame, allocate=True)
        if slot is None or frame.layer in slot.checksums:  # a layer in and checked is never written over
            return None
        self._placed = (frame, slot)
        return self.slots.layer(slot.index, frame.layer)

    def _placed_slot(self, frame: LayerFrame) -> Slot | None:
        """The slot of a layer written in place: the one `place` just gave (the transports
        place a layer right before they hand it over) while it still fills with that
        block, else looked up again."""
        placed_frame, slot = self._placed
        if placed_frame is frame and self.blocks.slots[slot.index] is slot and slot.state is State.FILLING:
            return slot
        return self._receiving(frame, allocate=False)

    def _receiving(self, frame: LayerFrame, allocate: bool) -> Slot | None:
        """The FILLING slot an arriving layer belongs in, or None (dropped: another
        geometry, a block given up on, complete already, or no room)."""
        if (frame.v != WIRE_VERSION or frame.geometry != self.slots.geometry or frame.model != self.model
                or not 0 <= frame.layer < self.blocks.layers):
            log.warning("transfer frame for another geometry dropped", model=frame.model)
            return None
        now = time.monotonic()
        if now - self._failed.get(frame.block_hash, -FAILED_MEMORY_S) < FAILED_MEMORY_S:
            return None
        if not allocate:
            slot = self.blocks.get(frame.block_hash)
            return slot if slot is not None and slot.state is State.FILLING else None
        slot = self.blocks.begin_receive(frame.block_hash, now)
        self._spill_evicted()
        if slot is None and self.blocks.get(frame.block_hash) is None:  # not here: no room for it
            self._give_up(frame.block_hash, now, "no room for an arriving block: dropped")
        return slot

    def _check_in(self, slot: Slot, frame: LayerFrame, payload: memoryview, copy: bool) -> None:
        # Sum the frame while the kernel's copy of it is still in cache, then copy.
        good = checksum(payload) == frame.checksum
        if good and copy:
            self.slots.layer(slot.index, frame.layer)[:] = payload
        self.node.counters.layers_in += 1
        self.node.counters.bytes_in += len(payload)
        self._arrived(slot, frame.layer, frame.checksum, good)
        if slot.state is State.READY:
            self.node.counters.blocks_received += 1

    # --- engines (notes socket) ----------------------------------------------------
    def release(self, owner: str) -> None:
        self.blocks.unpin(owner)

    def renew(self, r: Renew) -> None:
        self.blocks.renew(r.engine, r.owners, time.monotonic())

    def engine_gone(self, engine: str) -> None:
        owners = self.blocks.engine_gone(engine)
        if owners:
            log.info("engine gone: its pins released", engine=engine, owners=len(owners))

    def expire(self, now: float) -> None:
        """Release the pins whose lease lapsed: their engine died, or lost its Release notes."""
        lapsed = self.blocks.expire(now)
        if lapsed:
            self.node.upkeep.leases_lapsed += len(lapsed)
            log.warning("pin leases lapsed: pins released", owners=len(lapsed), first=lapsed[0])

    def written(self, w: Written) -> None:
        if w.pool_id != self.pool_id:
            log.warning("written note for another pool dropped", pool_id=w.pool_id)
            return
        if not len(w.slots) == len(w.hashes) == len(w.checksums):
            log.warning("malformed written note dropped", slots=len(w.slots), hashes=len(w.hashes))
            return
        for index, block_hash, layer_sum in zip(w.slots, w.hashes, w.checksums):
            if not 0 <= index < self.slots.count:
                continue
            slot = self.blocks.slots[index]
            if slot.block_hash != block_hash:  # a late note: its slot went to another block since
                self.node.refusals.stale_notes += 1
                log.warning("stale written note dropped", slot=index, layer=w.layer, block=block_hash.hex()[:16],
                            holds=slot.block_hash.hex()[:16])
                continue
            # The worker summed these very bytes in shared memory, so reading them
            # again proves nothing; the end-to-end check is the receiver's.
            self._arrived(slot, w.layer, layer_sum, good=True)

    # --- a layer arrived (written, received or read back) ---------------------------
    def _arrived(self, slot: Slot, layer: int, layer_sum: int, good: bool) -> None:
        dests, block_hash = set(slot.dests), slot.block_hash
        outcome = self.blocks.layer_arrived(slot, layer, layer_sum, good)
        if outcome == "failed":
            self.node.counters.checksum_failures += 1
            self._give_up(block_hash, time.monotonic(), "block failed its checksum: dropped", layer=layer)
            return
        if outcome == "ignored":
            return
        if self.options.stream_layers:
            for dest in dests:
                self._send_layer(slot, layer, dest)
        if outcome == "ready":
            self._ready(slot, dests)

    def _ready(self, slot: Slot, dests: set[str]) -> None:
        sums = [slot.checksums[i] for i in range(self.blocks.layers)]
        self.slots.write_header(slot.index, slot.block_hash, self.model_id, sums)
        if not self.options.stream_layers:
            for dest in dests:
                self._send_block(slot, dest)
        slot.dests.clear()
        self.node.block_event("ready", self.pool_id, [slot.block_hash])
        self.node.kv_event("stored", "dram", [slot.block_hash])

    def _give_up(self, block_hash: bytes, now: float, why: str, **fields: object) -> None:
        """An arriving block will not become ready here: engines waiting for it hear so
        (and compute it instead of waiting), and its other layers are ignored a while."""
        self._failed = {h: t for h, t in self._failed.items() if now - t < FAILED_MEMORY_S}
        self._failed[block_hash] = now
        self.node.block_event("failed", self.pool_id, [block_hash])
        log.warning(why, block=block_hash.hex()[:16], **fields)

    def _spill_evicted(self) -> None:
        """Spill what DRAM just evicted to SSD (its slot is still intact), or report it gone."""
        if not self.blocks.evicted:  # most calls: it is asked after every slot taken
            return
        gone: list[bytes] = []
        for block_hash, index in self.blocks.take_evicted():
            self.node.counters.evictions += 1
            self.node.kv_event("evicted", "dram", [block_hash])
            if self.ssd is None:
                gone.append(block_hash)
                continue
            dropped = self.ssd.put(block_hash, self.slots.slot(index))
            if dropped is None:  # the writer is behind: this block is not kept
                self.node.upkeep.spills_skipped += 1
                gone.append(block_hash)
                continue
            self.node.counters.spills += 1
            self.node.kv_event("stored", "ssd", [block_hash])
            if dropped:
                self.node.kv_event("removed", "ssd", dropped)
                gone.extend(h for h in dropped if h not in self.blocks.by_hash)
        if gone:
            self.node.block_event("evicted", self.pool_id, gone)

    # --- status --------------------------------------------------------------------
    def held(self) -> tuple[list[bytes], list[bytes]]:
        """The blocks held: ready in DRAM, and in the SSD tier."""
        return self.blocks.ready_hashes(), self.ssd.hashes() if self.ssd else []

    def gauges(self) -> dict[str, int]:
        counts = self.blocks.counts()
        if self.ssd is not None:
            counts.update(ssd_blocks=len(self.ssd), ssd_dropped=self.ssd.dropped)
        return counts

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
        remove(self.slots.file)
