"""A node's messenger: owns the node pool from start-up and moves its blocks.

`Messenger` is what app.py's loops and NATS handlers call: it routes the engines'
calls and notes and other messengers' layers to the pool, which is `Unattached`
until the first engine's Hello carves it (services/messenger/node_pool.py), and
reports the node's counters. Every call is synchronous and quick.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import structlog

from services.messenger.node import Node
from services.messenger.node_pool import NodePool, PoolOptions, SsdRead, Unattached
from services.messenger.transport import Transport
from shared.kv.pool_file import PoolFile
from shared.kv.wire import Control, Hello, Note, Release, Reply, frame_decoder, pool_path
from shared.messages import KvSnapshot, MessengerStats

log = structlog.get_logger(__name__)


class Messenger:
    def __init__(self, node: str, kv_dir: str, options: PoolOptions, transport: Transport) -> None:
        self.node = Node(node, transport, MessengerStats(node=node))
        Path(kv_dir).mkdir(parents=True, exist_ok=True)
        file = PoolFile(pool_path(kv_dir, node), options.pool_bytes, create=True)
        self.pool: Unattached | NodePool = Unattached(file, options, self.node)
        log.info("pool file created", path=str(file.path), pool_bytes=options.pool_bytes)

    # --- engines -------------------------------------------------------------------
    def control(self, message: Control) -> Reply:
        if isinstance(message, Hello):
            try:
                self.pool = self.pool.attach(message)
            except ValueError as e:  # no block of this geometry fits in pool_bytes
                return Reply(ok=False, error=str(e))
        return self.pool.control(message)

    def note(self, note: Note) -> None:
        if isinstance(note, Release):
            self.pool.release(note.owner)
        else:
            self.pool.written(note)

    def ssd_reads(self, owner: str, hashes: list[bytes]) -> list[SsdRead]:
        return self.pool.ssd_reads(owner, hashes)

    # --- other messengers ----------------------------------------------------------
    def received(self, header: bytes, payload: memoryview) -> None:
        """One layer from another messenger."""
        try:
            frame = frame_decoder.decode(header)
        except msgspec.DecodeError as e:
            log.warning("bad transfer frame dropped", error=str(e))
            return
        self.pool.received(frame, payload)

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
            **self.pool.gauges(),
        )

    def close(self) -> None:
        self.pool.close()
