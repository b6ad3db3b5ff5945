"""What the parts of one node's messenger share, whether or not its pool is carved
yet: its peers and the transport to them, its counters, the faults armed on it,
and what it has to tell the node's engines and the Conductor (app.py sends those
from its loops).

Peers are bounded: one whose heartbeats stopped for `forget_quiet`'s while, or that
came back on another endpoint, has its socket closed; a heartbeat brings it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import structlog

from services.messenger.transport import Transport
from shared.kv.wire import BlockEvent
from shared.messages import KvEvent, MessengerStats, Tier

log = structlog.get_logger(__name__)
BlockKind = Literal["ready", "failed", "evicted", "tick"]  # BlockEvent.kind
KvKind = Literal["stored", "evicted", "removed"]  # KvEvent.kind


@dataclass
class Faults:
    """Fault injection (MessengerCommand "fault" on the node's faults subject), for
    tests and drills: armed only where the messenger was started with
    --fault-injection, never in production."""

    enabled: bool = False
    corrupt_next: int = 0  # layers to damage on the way out
    no_room_next: int = 0  # reservations to refuse as if the pool were full


@dataclass
class Refusals:
    """What the messenger turned away, beside MessengerStats: its metrics page shows them."""

    stale_notes: int = 0  # engine notes naming a slot that holds another block by now
    fault_commands: int = 0  # fault commands while fault injection is off


@dataclass
class Upkeep:
    """What the messenger let go to stay bounded, beside MessengerStats (its metrics page shows them)."""

    leases_lapsed: int = 0  # owners whose pins were released because their lease ran out
    peers_closed: int = 0  # peer sockets closed: the peer went quiet or moved
    spills_skipped: int = 0  # evicted blocks not spilled: the SSD writer's queue was full


@dataclass(frozen=True)
class SecurityStats:
    """The messenger's guard, for its metrics page."""

    node: str
    kv_authenticated: bool  # peers must hold the cluster's KV key (off only with --kv-insecure)
    kv_peers_rejected: int
    stale_notes: int
    fault_commands_refused: int
    fault_injection_enabled: bool


@dataclass
class Node:
    name: str
    transport: Transport
    counters: MessengerStats  # the counters; Messenger.stats() adds the gauges
    faults: Faults = field(default_factory=Faults)
    refusals: Refusals = field(default_factory=Refusals)
    upkeep: Upkeep = field(default_factory=Upkeep)
    peers: dict[str, str] = field(default_factory=dict)  # node → transport endpoint
    heard: dict[str, float] = field(default_factory=dict)  # node → its last heartbeat (monotonic)
    events: list[BlockEvent] = field(default_factory=list)  # for the node's engines
    kv_events: list[KvEvent] = field(default_factory=list)  # for NATS: the Conductor's index

    def meet(self, node: str, endpoint: str, now: float = 0.0) -> bool:
        """A peer messenger's endpoint, from its heartbeat at `now`; True when it is news.
        A peer back on a new endpoint (it restarted) has its old socket closed."""
        if node == self.name or not endpoint:
            return False
        self.heard[node] = now
        old = self.peers.get(node)
        if old == endpoint:
            return False
        log.info("peer messenger", node=node, endpoint=endpoint, was=old)
        self.peers[node] = endpoint
        for by_peer in (self.counters.peer_layers_out, self.counters.peer_bytes_out):
            by_peer.setdefault(node, 0)  # its series on the page from the start, at 0
        if old is not None:
            self._close(old)
        self.transport.connect(endpoint)
        return True

    def forget_quiet(self, now: float, after_s: float) -> list[str]:
        """Close the sockets of peers not heard from for `after_s`; returns their nodes."""
        quiet = [node for node, seen in self.heard.items() if now - seen > after_s]
        for node in quiet:
            del self.heard[node]
            endpoint = self.peers.pop(node, None)
            if endpoint is not None:
                log.info("peer messenger quiet: its socket closed", node=node, endpoint=endpoint)
                self._close(endpoint)
        return quiet

    def _close(self, endpoint: str) -> None:
        if endpoint not in self.peers.values():  # another node's name for the same messenger keeps it
            self.transport.disconnect(endpoint)
            self.upkeep.peers_closed += 1

    def send(self, dest: str, header: bytes, payload: memoryview | bytes) -> None:
        """One layer to `dest`'s messenger, never waiting: a layer that cannot go is
        counted dropped, and its block is computed by its reader."""
        endpoint = self.peers.get(dest)
        if endpoint is None:
            self.counters.sends_dropped += 1
            log.warning("no messenger known for node", node=dest)
            return
        if self.faults.corrupt_next > 0:
            self.faults.corrupt_next -= 1
            self.counters.corrupted_on_purpose += 1
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0xFF
            payload = bytes(damaged)
        if self.transport.send(endpoint, header, payload):
            c = self.counters
            c.layers_out += 1
            c.bytes_out += len(payload)
            c.peer_layers_out[dest] = c.peer_layers_out.get(dest, 0) + 1
            c.peer_bytes_out[dest] = c.peer_bytes_out.get(dest, 0) + len(payload)
        else:
            self.counters.sends_dropped += 1

    def flush(self) -> None:
        """Send the layers queued in this step; those that cannot go are counted dropped
        (their blocks are computed by their readers)."""
        layers, nbytes = self.transport.flush()
        if layers:
            self.counters.sends_dropped += layers
            self.counters.layers_out -= layers
            self.counters.bytes_out -= nbytes

    def block_event(self, kind: BlockKind, pool_id: str, hashes: list[bytes]) -> None:
        """Queue an event for the node's engines. One that follows an event of the same
        kind and pool joins it: at 64 KiB a block a message per block cost the
        receiving messenger more than the block itself (order is kept)."""
        last = self.events[-1] if self.events else None
        if last is not None and last.kind == kind and last.pool_id == pool_id:
            last.hashes.extend(hashes)
            return
        self.events.append(BlockEvent(kind=kind, pool_id=pool_id, hashes=list(hashes)))

    def kv_event(self, kind: KvKind, tier: Tier, hashes: list[bytes]) -> None:
        """Queue a KV event for the Conductor, joined to the last one when it is of the same kind and tier."""
        if not hashes:
            return
        last = self.kv_events[-1] if self.kv_events else None
        if last is not None and last.kind == kind and last.tier == tier:
            last.hashes += [h.hex() for h in hashes]
            return
        self.kv_events.append(KvEvent(node=self.name, kind=kind, tier=tier, hashes=[h.hex() for h in hashes]))

    def take_events(self) -> list[BlockEvent]:
        out, self.events = self.events, []
        return out

    def take_kv_events(self) -> list[KvEvent]:
        out, self.kv_events = self.kv_events, []
        return out
