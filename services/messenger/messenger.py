"""A node's messenger: owns the node pool and moves its blocks.

It answers the node's engines (hello, reserve, pin, snapshot), takes the
workers' notes (layer written, pins released), streams each written layer to the messengers that
want the block, receives layers from other messengers into its own pool, and tells
its engines which blocks became ready or failed. Every handler is synchronous and
quick; app.py owns the sockets and the tasks that call in here.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from services.messenger.pool import BlockPool, Slot, State
from services.messenger.ssd import SsdTier
from services.messenger.transport import Transport
from shared.kv_pool import Header, PoolFile, checksum, model_id
from shared.kv_wire import (
    NO_ROOM,
    NOT_NEEDED,
    WIRE_VERSION,
    BlockEvent,
    Control,
    Hello,
    LayerFrame,
    Note,
    Pin,
    Release,
    Reply,
    Reserve,
    Snapshot,
    Written,
    control_encoder,
    frame_decoder,
    pool_path,
)
from shared.messages import KvEvent, KvSnapshot, MessengerStats, Tier

log = structlog.get_logger(__name__)
FAILED_MEMORY_S = 30.0  # layers of a block that failed are ignored this long


@dataclass(frozen=True)
class PoolOptions:
    pool_bytes: int
    eviction: str = "lru"
    ssd_path: str = ""  # empty: no SSD tier
    ssd_bytes: int = 0
    stream_layers: bool = True


class Messenger:
    def __init__(self, node: str, kv_dir: str, options: PoolOptions, transport: Transport) -> None:
        self.node = node
        self.kv_dir = kv_dir
        self.options = options
        self.transport = transport
        self.ssd: SsdTier | None = None
        self.file: PoolFile | None = None
        self.pool: BlockPool | None = None
        self.pool_id = ""
        self.model = ""
        self.peers: dict[str, str] = {}  # node → transport endpoint
        self.events: list[BlockEvent] = []  # to publish to the engines (app.py drains it)
        self.kv_events: list[KvEvent] = []  # to publish on NATS, for the Conductor's index
        self.counters = MessengerStats(node=node)  # the counters; stats() adds the gauges
        self.corrupt_next = 0  # fault injection: layers to damage on the way out
        self.no_room_next = 0  # fault injection: reservations to refuse as if the pool were full
        self._failed: dict[bytes, float] = {}

    # --- engines (control socket) --------------------------------------------------
    def control(self, message: Control) -> Reply:
        if isinstance(message, Hello):
            return self._hello(message)
        if self.pool is None:
            return Reply(ok=False, error="no pool yet: no engine has said hello on this node")
        if isinstance(message, Reserve):
            return self._reserve(message)
        if isinstance(message, Pin):
            return Reply(pool_id=self.pool_id, slots=self._pin(message.owner, message.hashes))
        if isinstance(message, Snapshot):
            ssd = [h for h in self.ssd.hashes() if h not in self.pool.by_hash] if self.ssd else []
            return Reply(pool_id=self.pool_id, ready=self.pool.ready_hashes() + ssd)
        return Reply(ok=False, error=f"unknown call {type(message).__name__}")

    def _hello(self, hello: Hello) -> Reply:
        if self.file is None:
            Path(self.kv_dir).mkdir(parents=True, exist_ok=True)
            slots = self.options.pool_bytes // hello.geometry.slot_bytes
            if slots < 1:
                return Reply(ok=False, error=f"pool_bytes {self.options.pool_bytes} holds no block of {hello.geometry.slot_bytes} bytes")
            path = pool_path(self.kv_dir, self.node)
            self.file = PoolFile(path, hello.geometry, slots, create=True)
            self.pool = BlockPool(slots, hello.geometry.layers, eviction=self.options.eviction)
            self.pool_id = uuid.uuid4().hex[:12]
            self.model = hello.model
            if self.options.ssd_path:
                self.ssd = SsdTier(Path(self.options.ssd_path), self.options.ssd_bytes, hello.geometry, model_id(hello.model))
                self._kv_event("stored", "ssd", self.ssd.hashes())
            log.info("pool created", path=str(path), slots=slots, block_bytes=hello.geometry.slot_bytes,
                     geometry=msgspec.structs.asdict(hello.geometry), pool_id=self.pool_id)
        elif hello.geometry != self.file.geometry or hello.model != self.model:
            return Reply(ok=False, error=f"this node's pool holds {self.model} blocks of {self.file.geometry}, "
                                         f"not {hello.model} blocks of {hello.geometry}")
        return Reply(pool_id=self.pool_id, pool_path=str(self.file.path), pool_slots=self.file.slots)

    def _reserve(self, r: Reserve) -> Reply:
        assert self.pool is not None
        now = time.monotonic()
        dest = r.dest if r.dest and r.dest != self.node else ""
        slots = []
        for h in r.hashes:
            if self.no_room_next > 0:
                self.no_room_next -= 1
                slots.append(NO_ROOM)
                continue
            index, slot = self.pool.reserve(h, r.owner, now)
            slots.append(index)
            if slot is not None and dest:
                self._want(slot, dest)
        self._publish_evictions()
        if NO_ROOM in slots:
            log.warning("pool full of pinned blocks", owner=r.owner, refused=slots.count(NO_ROOM))
        return Reply(pool_id=self.pool_id, slots=slots)

    def _pin(self, owner: str, hashes: list[bytes]) -> list[int]:
        """Pin the leading run of `hashes` held here, promoting SSD blocks to DRAM."""
        assert self.pool is not None
        slots = []
        for h in hashes:
            index = self.pool.pin_one(owner, h)
            if index is None and self._promote(owner, h) is not None:
                index = self.pool.pin_one(owner, h)
            if index is None:
                self.counters.misses += 1
                break
            self._count_hit(self.pool.slots[index])
            slots.append(index)
        return slots

    def _count_hit(self, slot: Slot) -> None:
        """A block served (pinned, or sent to a puller): from DRAM, or read back from SSD for it."""
        if slot.from_ssd:
            slot.from_ssd = False
            self.counters.hits_ssd += 1
        else:
            self.counters.hits_dram += 1

    # --- SSD reads: a block coming back from disk arrives like one from the network --
    def ssd_reads(self, owner: str, hashes: list[bytes]) -> list[tuple[bytes, Slot]]:
        """The leading blocks of `hashes` that only the SSD tier holds, each given a
        DRAM slot to be read into (FILLING: invisible until verified). app.py reads
        them on a thread (`ssd_load`) before the pin or the send that needs them, so a
        disk read never stalls the event loop; `_promote` does the same inline.
        Every block of the run, here or read back, is pinned for `owner` meanwhile:
        making room for one must not evict another the same pin is about to take."""
        todo: list[tuple[bytes, Slot]] = []
        if self.ssd is None or self.pool is None:
            return todo
        for h in hashes:
            if self.pool.get(h) is None and h not in self.ssd:
                break
            index, slot = self.pool.reserve(h, owner, time.monotonic())  # pins it; a new slot is FILLING
            self._publish_evictions()
            if slot is None:  # every slot pinned
                break
            if index != NOT_NEEDED:
                todo.append((h, slot))
        return todo

    def ssd_load(self, block_hash: bytes, slot: Slot) -> list[int] | None | Exception:
        """Disk into the slot, verified (thread-safe): the layer checksums, None when
        the file is gone, or the error that shows it damaged."""
        assert self.ssd is not None and self.file is not None
        try:
            return self.ssd.load(block_hash, self.file.slot(slot.index))
        except Exception as e:  # whatever went wrong, the block is not served and its slot is freed
            return e

    def ssd_read_done(self, block_hash: bytes, slot: Slot, found: list[int] | None | Exception) -> bool:
        """Back on the loop: the block is READY in DRAM, or its slot is freed."""
        assert self.ssd is not None and self.pool is not None
        sums = self.ssd.settle(block_hash, found)
        if isinstance(found, Exception):
            self._kv_event("removed", "ssd", [block_hash])
        ours = slot.block_hash == block_hash and slot.state is State.FILLING  # not reclaimed meanwhile
        if sums is None or not ours:
            if ours:
                self.pool.drop(slot)
            return False
        for layer, layer_sum in enumerate(sums):
            self._arrived(slot, layer, layer_sum, good=True)
        slot.from_ssd = slot.state is State.READY
        return slot.from_ssd

    def _promote(self, owner: str, block_hash: bytes) -> Slot | None:
        """Bring a block back from SSD into a DRAM slot pinned for `owner`, inline
        (what app.py has not read ahead on a thread)."""
        todo = self.ssd_reads(owner, [block_hash])
        if not todo:
            return None
        ((h, slot),) = todo
        return slot if self.ssd_read_done(h, slot, self.ssd_load(h, slot)) else None

    def send_to(self, dest: str, hashes: list[bytes], skip: int = 0, owner: str = "") -> int:
        """Push the leading run of `hashes` held here to `dest` (a pull from there),
        but for the first `skip`, which `dest` holds already; returns how many leading
        blocks `dest` will then have. `owner`: the pins of blocks read back for this
        send (`ssd_reads`), released here."""
        if self.pool is None:
            return 0
        owner = owner or f"send-{dest}"
        skip = max(0, min(skip, len(hashes)))
        sent = skip
        for h in hashes[skip:]:
            slot = self.pool.get(h) or self._promote(owner, h)
            if slot is None or slot.state is not State.READY:
                break
            self._count_hit(slot)
            self._send_block(slot, dest)
            sent += 1
        self.pool.unpin(owner)
        return sent

    def _want(self, slot: Slot, dest: str) -> None:
        """`dest` wants this block: send what has arrived, and the rest as it arrives."""
        if slot.state is State.READY:
            self._send_block(slot, dest)
            return
        slot.dests.add(dest)
        if self.options.stream_layers:
            for layer in sorted(slot.checksums):
                self._send_layer(slot, layer, dest)

    # --- engines (notes socket) ------------------------------------------------------
    def note(self, note: Note) -> None:
        if isinstance(note, Release):
            if self.pool is not None:
                self.pool.unpin(note.owner)
        else:
            self.written(note)

    def written(self, w: Written) -> None:
        if self.pool is None or self.file is None or w.pool_id != self.pool_id:
            log.warning("written note for another pool dropped", pool_id=w.pool_id)
            return
        for index, layer_sum in zip(w.slots, w.checksums):
            if 0 <= index < self.file.slots:
                # The worker summed these very bytes in shared memory, so reading them
                # again proves nothing; the end-to-end check is the receiver's.
                self._arrived(self.pool.slots[index], w.layer, layer_sum, good=True)

    def _arrived(self, slot: Slot, layer: int, layer_sum: int, good: bool) -> None:
        assert self.pool is not None and self.file is not None
        dests, block_hash = set(slot.dests), slot.block_hash
        outcome = self.pool.layer_arrived(slot, layer, layer_sum, good)
        if outcome == "failed":
            self.counters.checksum_failures += 1
            self._give_up(block_hash, time.monotonic(), "block failed its checksum: dropped", layer=layer)
            return
        if outcome == "ignored":
            return
        if self.options.stream_layers:
            for dest in dests:
                self._send_layer(slot, layer, dest)
        if outcome == "ready":
            self.file.write_header(slot.index, Header(block_hash, model_id(self.model), self.file.geometry,
                                                      [slot.checksums[i] for i in range(self.pool.layers)]))
            if not self.options.stream_layers:
                for dest in dests:
                    self._send_block(slot, dest)
            slot.dests.clear()
            self.events.append(BlockEvent(kind="ready", pool_id=self.pool_id, hashes=[block_hash]))
            self._kv_event("stored", "dram", [block_hash])

    def _give_up(self, block_hash: bytes, now: float, why: str, **fields: object) -> None:
        """An arriving block will not become ready here: engines waiting for it hear so
        (and compute it instead of waiting), and its other layers are ignored a while."""
        self._failed = {h: t for h, t in self._failed.items() if now - t < FAILED_MEMORY_S}
        self._failed[block_hash] = now
        self.events.append(BlockEvent(kind="failed", pool_id=self.pool_id, hashes=[block_hash]))
        log.warning(why, block=block_hash.hex()[:16], **fields)

    # --- other messengers (transport) ----------------------------------------------
    def _send_block(self, slot: Slot, dest: str) -> None:
        for layer in range(self.pool.layers if self.pool else 0):
            self._send_layer(slot, layer, dest)

    def _send_layer(self, slot: Slot, layer: int, dest: str) -> None:
        assert self.file is not None
        endpoint = self.peers.get(dest)
        if endpoint is None:
            self.counters.sends_dropped += 1
            log.warning("no messenger known for node", node=dest)
            return
        header = control_encoder.encode(LayerFrame(block_hash=slot.block_hash, layer=layer, checksum=slot.checksums[layer],
                                    geometry=self.file.geometry, model=self.model))
        payload: memoryview | bytes = self.file.layer(slot.index, layer)
        if self.corrupt_next > 0:
            self.corrupt_next -= 1
            self.counters.corrupted_on_purpose += 1
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0xFF
            payload = bytes(damaged)
        if self.transport.send(endpoint, header, payload):
            self.counters.layers_out += 1
            self.counters.bytes_out += len(payload)
        else:
            self.counters.sends_dropped += 1

    def received(self, header: bytes, payload: memoryview) -> None:
        """One layer from another messenger: into the pool, checked, maybe completing a block."""
        if self.pool is None or self.file is None:
            return
        try:
            frame = frame_decoder.decode(header)
        except msgspec.DecodeError as e:
            log.warning("bad transfer frame dropped", error=str(e))
            return
        if (frame.v != WIRE_VERSION or frame.geometry != self.file.geometry or frame.model != self.model
                or len(payload) != self.file.geometry.layer_bytes):
            log.warning("transfer frame for another geometry dropped", model=frame.model)
            return
        now = time.monotonic()
        if now - self._failed.get(frame.block_hash, -FAILED_MEMORY_S) < FAILED_MEMORY_S:
            return
        slot = self.pool.begin_receive(frame.block_hash, now)
        self._publish_evictions()
        if slot is None:
            if self.pool.get(frame.block_hash) is None:  # not here: no room for it
                self._give_up(frame.block_hash, now, "no room for an arriving block: dropped")
            return
        # Sum the frame while the kernel's copy of it is still in cache, then copy.
        good = checksum(payload) == frame.checksum
        if good:
            self.file.layer(slot.index, frame.layer)[:] = payload
        self.counters.layers_in += 1
        self.counters.bytes_in += len(payload)
        self._arrived(slot, frame.layer, frame.checksum, good)
        if slot.state is State.READY:
            self.counters.blocks_received += 1

    def _publish_evictions(self) -> None:
        """Spill what DRAM just evicted to SSD (its slot is still intact), or report it gone."""
        if self.pool is None or self.file is None:
            return
        gone: list[bytes] = []
        for block_hash, index in self.pool.take_evicted():
            self.counters.evictions += 1
            self._kv_event("evicted", "dram", [block_hash])
            if self.ssd is None:
                gone.append(block_hash)
                continue
            self.counters.spills += 1
            self._kv_event("stored", "ssd", [block_hash])
            dropped = self.ssd.put(block_hash, self.file.slot(index))
            if dropped:
                self._kv_event("removed", "ssd", dropped)
                gone.extend(h for h in dropped if h not in self.pool.by_hash)
        if gone:
            self.events.append(BlockEvent(kind="evicted", pool_id=self.pool_id, hashes=gone))

    def _kv_event(self, kind: str, tier: Tier, hashes: list[bytes]) -> None:
        if hashes:
            self.kv_events.append(KvEvent(node=self.node, kind=kind, tier=tier, hashes=[h.hex() for h in hashes]))  # type: ignore[arg-type]

    def snapshot(self) -> KvSnapshot:
        dram = [h.hex() for h in self.pool.ready_hashes()] if self.pool else []
        ssd = [h.hex() for h in self.ssd.hashes()] if self.ssd else []
        return KvSnapshot(node=self.node, dram=dram, ssd=ssd)

    def take_kv_events(self) -> list[KvEvent]:
        out, self.kv_events = self.kv_events, []
        return out

    # --- status --------------------------------------------------------------------
    def take_events(self) -> list[BlockEvent]:
        out, self.events = self.events, []
        return out

    def stats(self) -> MessengerStats:
        counts = self.pool.counts() if self.pool else {}
        return msgspec.structs.replace(
            self.counters,
            endpoint=self.transport.endpoint,
            peers=sorted(self.peers),
            pool_slots=counts.get("slots", 0),
            ready=counts.get("ready", 0),
            filling=counts.get("filling", 0),
            pinned=counts.get("pinned", 0),
            corrupt_pending=self.corrupt_next,
            no_room_pending=self.no_room_next,
            ssd_blocks=len(self.ssd) if self.ssd else 0,
            ssd_dropped=self.ssd.dropped if self.ssd else 0,
        )

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
        if self.file is not None:
            self.file.close()
            try:
                os.unlink(self.file.path)
            except OSError:
                pass
