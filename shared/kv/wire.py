"""What travels between a node's vLLM engines and its messenger (ZeroMQ IPC), and
between messengers (ZeroMQ TCP): schemas and endpoint names.

Three local sockets per node, all bound by the messenger:
- control (REQ → ROUTER): hello, reserve, pin, snapshot; always answered;
- notes (PUSH → PULL): "layer i of these slots is in the pool", "release my pins",
  "these requests of mine are still running" (lease renewal), "this engine is gone";
- events (PUB → SUB): blocks that became ready or failed, and a tick that tells the
  engines the messenger is alive and which pool it holds ("" until an engine's Hello
  carves one: a restarted messenger's engines say hello again when they see that).

Pins are leases: a pin made by a Reserve or Pin lapses `Reply.lease_s` seconds after
its owner was last renewed, so an engine that crashes (its Release notes never
sent) cannot fill the pool with pinned slots.
Between messengers a transfer is a stream of layers, (LayerFrame, bytes), one per
layer of a block, so a layer can leave as soon as prefill has computed it; the
transport carries them (services/messenger/transport.py batches a peer's layers into
one ZeroMQ message, mooncake_transport.py writes them in place and sends the
LayerFrame after).
Everything here is msgpack (msgspec); block hashes travel as raw 16-byte digests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from shared.kv.pool_file import Geometry

WIRE_VERSION = 1

# Slot numbers a Reserve may answer with, besides a real slot.
NOT_NEEDED = -1  # already in the pool (or on its way): nothing to write
NO_ROOM = -2  # the pool is full of pinned blocks: decode will recompute this block

# How long a block that failed (bad checksum, no room on arrival) stays failed: the
# messenger ignores its late layers this long, and engines stop waiting for it.
FAILED_MEMORY_S = 30.0


def control_endpoint(kv_dir: str, node: str) -> str:
    return f"ipc://{Path(kv_dir) / node}.ctl"


def written_endpoint(kv_dir: str, node: str) -> str:
    return f"ipc://{Path(kv_dir) / node}.wr"


def events_endpoint(kv_dir: str, node: str) -> str:
    return f"ipc://{Path(kv_dir) / node}.ev"


def pool_path(kv_dir: str, node: str) -> Path:
    return Path(kv_dir) / f"{node}.pool"


# --- control: engine → messenger, request/reply -------------------------------------
class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """A worker's KV geometry; the first hello on a node cuts its pool into slots of
    it, and a later hello with another geometry or model is refused."""

    geometry: Geometry
    model: str


class Reserve(msgspec.Struct, tag="reserve", kw_only=True):
    """Slots for blocks prefill is about to save, pinned for `owner`; `dest` is the
    node whose messenger should receive them ("" or our own node: nowhere).
    `engine` names the engine holding the pins (its Renew notes keep them)."""

    owner: str
    hashes: list[bytes]
    dest: str = ""
    engine: str = ""
    trace: dict[str, str] = {}  # the request's trace context (its first reservation): the push span joins it


class Pin(msgspec.Struct, tag="pin", kw_only=True):
    """Pin the leading ready blocks of `hashes` for `owner` (a load is about to read them)."""

    owner: str
    hashes: list[bytes]
    engine: str = ""


class Snapshot(msgspec.Struct, tag="snapshot", kw_only=True):
    """Every ready block, so an engine that (re)connects can fill its index."""


Control = Hello | Reserve | Pin | Snapshot


class Reply(msgspec.Struct, kw_only=True):
    ok: bool = True
    error: str = ""
    pool_id: str = ""  # names the carved pool; changes when the messenger restarts: remap the pool file
    pool_path: str = ""
    pool_slots: int = 0
    slots: list[int] = []
    ready: list[bytes] = []
    lease_s: float = 0.0  # pins lapse this long after their last renewal (0: unknown)


# --- notes: engine → messenger, never answered (so never waited for) ------------------
class Written(msgspec.Struct, tag="written", kw_only=True):
    """Layer `layer` of these slots is in the pool, with these checksums. `hashes`
    names the block each slot was reserved for: a note that arrives after its slot
    went to another block (the reservation timed out, say) must not mark that other
    block's layer as written, so the messenger drops a slot whose block differs."""

    pool_id: str
    layer: int
    slots: list[int]
    hashes: list[bytes]
    checksums: list[int]


class Release(msgspec.Struct, tag="release", kw_only=True):
    """Drop `owner`'s pins: its load is done, or it finished."""

    owner: str


class Renew(msgspec.Struct, tag="renew", kw_only=True):
    """`engine` is alive and these owners (its in-flight requests) still need their
    pins: their leases start again. An owner not renewed for the lease lapses."""

    engine: str
    owners: list[str]


class Bye(msgspec.Struct, tag="bye", kw_only=True):
    """`engine` is shutting down: every pin it holds goes now, not at lease expiry."""

    engine: str


Note = Written | Release | Renew | Bye


# --- events: messenger → engines ------------------------------------------------------
class BlockEvent(msgspec.Struct, kw_only=True):
    kind: Literal["ready", "failed", "evicted", "tick"]
    pool_id: str
    hashes: list[bytes] = []


# --- transfer: messenger → messenger -------------------------------------------------
class LayerFrame(msgspec.Struct, kw_only=True):
    """Header frame of one layer's part of one block; the payload is the next frame."""

    v: int = WIRE_VERSION
    block_hash: bytes
    layer: int
    checksum: int
    geometry: Geometry
    model: str


control_encoder = msgspec.msgpack.Encoder()
control_decoder = msgspec.msgpack.Decoder(Control)
reply_decoder = msgspec.msgpack.Decoder(Reply)
note_decoder = msgspec.msgpack.Decoder(Note)
event_decoder = msgspec.msgpack.Decoder(BlockEvent)
frame_decoder = msgspec.msgpack.Decoder(LayerFrame)
