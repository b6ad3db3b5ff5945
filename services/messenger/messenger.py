"""A node's messenger: owns the node pool from start-up and moves its blocks.

`Messenger` is what app.py's loops and NATS handlers call: it routes the engines'
calls and notes and other messengers' layers to the pool, which is `Unattached`
until the first engine's Hello carves it (services/messenger/node_pool.py), and
reports the node's counters. Every call is synchronous and quick. `upkeep`, on
every tick, lets go of what nobody holds any more: pins whose lease lapsed, and
peers that stopped beating.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import structlog

from services.messenger.node import Faults, Node, SecurityStats, Upkeep
from services.messenger.node_pool import NodePool, PoolOptions, SsdRead, Unattached
from services.messenger.pushes import Pushes
from services.messenger.transport import Transport
from shared.kv.pool_file import PoolFile
from shared.kv.wire import (
    Bye,
    Control,
    Hello,
    LayerFrame,
    Note,
    Release,
    Renew,
    Reply,
    Reserve,
    frame_decoder,
    pool_path,
)
from shared.messages import KvSnapshot, MessengerAck, MessengerStats
from shared.private_file import private_dir

log = structlog.get_logger(__name__)
PEER_FORGET_S = 60.0  # a peer messenger silent this long has its socket closed


class Messenger:
    def __init__(self, node: str, kv_dir: str, options: PoolOptions, transport: Transport,
                 fault_injection: bool = False, peer_forget_s: float = PEER_FORGET_S) -> None:
        self.node = Node(node, transport, MessengerStats(node=node), faults=Faults(enabled=fault_injection))
        self.peer_forget_s = peer_forget_s
        private_dir(kv_dir, repair=True)  # the pool file is the node's KV cache: ours alone
        file = PoolFile(pool_path(kv_dir, node), options.pool_bytes, create=True)
        self.pool: Unattached | NodePool = Unattached(file, options, self.node)
        self._placed: tuple[bytes, LayerFrame | None] = (b"", None)  # the last header placed, decoded
        self.pushes = Pushes(node)  # trace spans of requests' pushes to other nodes
        transport.attach(file.view, self.place)
        log.info("pool file created", path=str(file.path), pool_bytes=options.pool_bytes)

    @property
    def carved(self) -> bool:
        """Whether an engine's Hello has cut the pool into slots yet."""
        return isinstance(self.pool, NodePool)

    # --- engines -------------------------------------------------------------------
    def control(self, message: Control) -> Reply:
        if isinstance(message, Hello):
            try:
                self.pool = self.pool.attach(message)
            except ValueError as e:  # no block of this geometry fits in pool_bytes
                return Reply(ok=False, error=str(e))
        if isinstance(message, Reserve):
            self.pushes.reserved(message, time.monotonic())
        return self.pool.control(message)

    def note(self, note: Note) -> None:
        if isinstance(note, Release):
            self.pool.release(note.owner)
            self.pushes.released(note.owner)
        elif isinstance(note, Renew):
            self.pool.renew(note)
        elif isinstance(note, Bye):
            self.pool.engine_gone(note.engine)
        else:
            self.pool.written(note)

    def upkeep(self, now: float) -> None:
        """Release lapsed pins and close quiet peers (`now`: time.monotonic())."""
        self.pool.expire(now)
        self.pushes.expire(now)
        self.node.forget_quiet(now, self.peer_forget_s)

    def ssd_reads(self, owner: str, hashes: list[bytes]) -> list[SsdRead]:
        return self.pool.ssd_reads(owner, hashes)

    # --- other messengers ----------------------------------------------------------
    def received(self, header: bytes, payload: memoryview | None) -> None:
        """One layer from another messenger (None: written in place already, to be checked)."""
        frame = self._frame(header)
        if frame is not None:
            self.pool.received(frame, payload)

    def place(self, header: bytes) -> memoryview | None:
        """Where the layer another messenger is about to write goes in our pool (None: nowhere)."""
        frame = self._frame(header)
        if frame is None:
            return None
        self._placed = (header, frame)
        return self.pool.place(frame)

    def _frame(self, header: bytes) -> LayerFrame | None:
        """The header decoded; once only for a layer placed and then received (the
        transports place a layer right before they hand it over)."""
        placed_header, frame = self._placed
        if header == placed_header:
            return frame
        try:
            return frame_decoder.decode(header)
        except msgspec.DecodeError as e:
            log.warning("bad transfer frame dropped", error=str(e))
            return None

    def send_to(self, dest: str, hashes: list[bytes], skip: int = 0, owner: str = "") -> int:
        return self.pool.send_to(dest, hashes, skip, owner)

    # --- status --------------------------------------------------------------------
    def snapshot(self) -> KvSnapshot:
        dram, ssd = self.pool.held()
        return KvSnapshot(node=self.node.name, dram=[h.hex() for h in dram], ssd=[h.hex() for h in ssd])

    def stats(self) -> MessengerStats:
        node = self.node
        return msgspec.structs.replace(
            node.counters,
            endpoint=node.transport.endpoint,
            peers=sorted(node.peers),
            corrupt_pending=node.faults.corrupt_next,
            no_room_pending=node.faults.no_room_next,
            peer_layers_out=dict(node.counters.peer_layers_out),  # copies: the page reads them on another thread
            peer_bytes_out=dict(node.counters.peer_bytes_out),
            **self.pool.gauges(),
        )

    def upkeep_stats(self) -> Upkeep:
        """What was let go to stay bounded (a copy: the page reads it on another thread)."""
        return dataclasses.replace(self.node.upkeep)

    def security(self) -> SecurityStats:
        node = self.node
        return SecurityStats(
            node=node.name,
            kv_authenticated=node.transport.authenticated,
            kv_peers_rejected=node.transport.rejected,
            stale_notes=node.refusals.stale_notes,
            fault_commands_refused=node.refusals.fault_commands,
            fault_injection_enabled=node.faults.enabled,
        )

    # --- fault injection (tests and drills) ---------------------------------------
    def arm_faults(self, corrupt_next: int, no_room_next: int) -> MessengerStats | MessengerAck:
        """Arm the fault switches, where --fault-injection allows it; the stats, or a refusal."""
        faults = self.node.faults
        if not faults.enabled:
            self.node.refusals.fault_commands += 1
            log.warning("fault command refused: fault injection is off", corrupt_next=corrupt_next,
                        no_room_next=no_room_next)
            return MessengerAck(ok=False, error="fault injection is off on this messenger (--fault-injection)")
        faults.corrupt_next, faults.no_room_next = max(0, corrupt_next), max(0, no_room_next)
        log.warning("fault injection armed", corrupt_next=faults.corrupt_next, no_room_next=faults.no_room_next)
        return self.stats()

    def close(self) -> None:
        self.pool.close()
