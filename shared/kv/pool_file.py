"""The node pool's memory: a file in shared memory cut into fixed-size slots, one
KV block per slot, that the messenger and the node's vLLM workers both map. The
messenger creates the file at start-up (`PoolFile`, pool_bytes long); the first
engine's Hello names the block geometry that cuts it into slots (`PoolSlots`).

Slot layout (DESIGN.md, "Pool block layout"): a 4 KiB header, then the block's KV
layer by layer, each layer's part contiguous, so that streaming a block layer by
layer is a sequence of contiguous sends and no reader ever gathers:

    [header | layer 0 | layer 1 | ... | layer L-1]

A layer's part is exactly one vLLM KV-cache block of that layer, copied byte for
byte in the engine's own layout (recorded in the geometry, and checked on both ends
of a transfer). The header (hash, model id, layer count, dtype, shape, checksums) is
written when the block is complete, so a slot copied to disk describes itself.

The node's KV folder (pool file, engine sockets) and SSD tier are owner-only (0700),
their files 0600, created with O_EXCL|O_NOFOLLOW: whoever can write a pool file can
plant KV blocks, and whoever can read it reads every prompt's KV.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import msgspec
import structlog
import xxhash

from shared.private_file import new_private_file

log = structlog.get_logger(__name__)

HEADER_BYTES = 4096
MAGIC = b"YBKV"
HEADER_VERSION = 1
# magic, version, layers, hash, model id, dtype, H, N, C, layer bytes, payload checksum
_HEAD = struct.Struct("<4sHH16sQ16sIIIQQ")
MAX_LAYERS = (HEADER_BYTES - _HEAD.size) // 8


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """What one block holds: `layers` parts of `shape` (heads, tokens, content) in
    `dtype`, in the attention backend's `layout`. Both ends of a transfer must agree."""

    layers: int
    shape: tuple[int, int, int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    itemsize: int
    layout: str  # e.g. "LBHNC" on CPU: part of the contract, never converted

    def __post_init__(self) -> None:
        if not 0 < self.layers <= MAX_LAYERS:
            raise ValueError(f"layers must be in 1..{MAX_LAYERS}, got {self.layers}")
        if min(self.shape) <= 0 or self.itemsize <= 0:  # a frame's geometry is checked per layer received
            raise ValueError(f"bad block shape {self.shape} × {self.itemsize} bytes")

    @property
    def layer_bytes(self) -> int:
        h, n, c = self.shape
        return h * n * c * self.itemsize

    @property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + self.layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        """Offset of a layer's part inside a slot."""
        return HEADER_BYTES + layer * self.layer_bytes


def checksum(data: memoryview | bytes) -> int:
    """Checksum of one layer's part (xxh3-64: several GB/s, so it costs little beside the copy)."""
    return xxhash.xxh3_64_intdigest(data)


@functools.cache
def _checksums(layers: int) -> struct.Struct:
    """The packing of a block's layer checksums in its header."""
    return struct.Struct(f"<{layers}Q")


def _sums_checksum(buffer: bytes | bytearray | memoryview, at: int, layers: int) -> int:
    """A header's own checksum: over its layer checksums, as they lie packed at `at`."""
    return xxhash.xxh3_64_intdigest(memoryview(buffer)[at : at + 8 * layers])


def model_id(name: str) -> int:
    return xxhash.xxh3_64_intdigest(name.encode())


def pack_header(buffer: bytearray | memoryview, offset: int, block_hash: bytes, model: int, geometry: Geometry,
                layer_checksums: list[int]) -> None:
    """A slot's header written where it goes (the slot's start): the messenger writes
    one per block it takes in, so the checksums are packed once and summed where they lie."""
    at = offset + _HEAD.size
    _checksums(geometry.layers).pack_into(buffer, at, *layer_checksums)
    total = _sums_checksum(buffer, at, geometry.layers)
    _HEAD.pack_into(buffer, offset, MAGIC, HEADER_VERSION, geometry.layers, block_hash, model,
                    geometry.dtype.encode(), *geometry.shape, geometry.layer_bytes, total)


class Header(NamedTuple):
    """A slot's header, as read back (SSD tier, engines) or built by tests."""

    block_hash: bytes
    model: int
    geometry: Geometry
    layer_checksums: list[int]

    def pack(self) -> bytes:
        out = bytearray(_HEAD.size + 8 * self.geometry.layers)
        self.pack_into(out, 0)
        return bytes(out)

    def pack_into(self, buffer: bytearray | memoryview, offset: int) -> None:
        pack_header(buffer, offset, self.block_hash, self.model, self.geometry, self.layer_checksums)

    @staticmethod
    def unpack(data: bytes | memoryview, itemsize: int, layout: str) -> Header:
        head = _HEAD.unpack_from(data)
        magic, version, layers, block_hash, model, dtype, h, n, c, layer_bytes, total = head
        if magic != MAGIC or version != HEADER_VERSION:
            raise ValueError("not a Yuebing pool block")
        if not 0 < layers <= MAX_LAYERS:
            raise ValueError(f"bad layer count {layers}")
        sums = list(_checksums(layers).unpack_from(data, _HEAD.size))
        if _sums_checksum(data, _HEAD.size, layers) != total:
            raise ValueError("header checksum mismatch")
        dtype_name = dtype.rstrip(b"\0").decode()
        geometry = Geometry(layers=layers, shape=(h, n, c), dtype=dtype_name, itemsize=itemsize, layout=layout)
        if geometry.layer_bytes != layer_bytes:
            raise ValueError("header sizes disagree")
        return Header(block_hash, model, geometry, sums)


class PoolFile:
    """A pool file mapped into this process: `size` bytes of shared memory. The
    messenger creates it at start-up; engines map it once it is carved (`PoolSlots`)."""

    def __init__(self, path: Path, size: int, create: bool) -> None:
        if size <= 0:
            raise ValueError(f"a pool file needs a positive size, got {size}")
        self.path = path
        self.size = size
        fd = new_private_file(path) if create else os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"pool file {path} is smaller than {size} bytes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            self._populate()
        self.view = memoryview(self._map)

    def _populate(self) -> None:
        """Fault every page in now: a fresh shared-memory page costs a fault and a
        zeroing on first write, which otherwise lands on the first transfers (it
        measured 1.5 GB/s instead of memcpy speed)."""
        advice = getattr(mmap, "MADV_POPULATE_WRITE", None)
        if advice is not None:
            try:
                self._map.madvise(advice)
                return
            except OSError:  # kernels before 5.14
                pass
        page = mmap.PAGESIZE
        for offset in range(0, len(self._map), page):
            self._map[offset] = 0

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a zero-copy frame still holds a view; the OS unmaps at exit
            pass


class PoolSlots:
    """A pool file cut into `count` slots of `geometry.slot_bytes`, one block each."""

    def __init__(self, file: PoolFile, geometry: Geometry) -> None:
        self.file = file
        self.geometry = geometry
        # Sizes kept as numbers: the messenger looks up a slot's layer for every layer it moves.
        self._slot_bytes, self._layer_bytes = geometry.slot_bytes, geometry.layer_bytes
        self.count = file.size // geometry.slot_bytes
        if self.count < 1:
            raise ValueError(f"a pool of {file.size} bytes holds no block of {geometry.slot_bytes} bytes")

    @staticmethod
    def open(path: Path | str, geometry: Geometry, count: int) -> PoolSlots:
        """An engine's mapping of the node's pool, as its messenger's Hello reply describes it."""
        return PoolSlots(PoolFile(Path(path), count * geometry.slot_bytes, create=False), geometry)

    @property
    def view(self) -> memoryview:
        return self.file.view

    def slot(self, slot: int) -> memoryview:
        start = slot * self._slot_bytes
        return self.file.view[start : start + self._slot_bytes]

    def layer(self, slot: int, layer: int) -> memoryview:
        """One layer's part of a slot: writable, zero-copy."""
        start = slot * self._slot_bytes + HEADER_BYTES + layer * self._layer_bytes
        return self.file.view[start : start + self._layer_bytes]

    def write_header(self, slot: int, block_hash: bytes, model: int, layer_checksums: list[int]) -> None:
        pack_header(self.file.view, slot * self._slot_bytes, block_hash, model, self.geometry, layer_checksums)

    def close(self) -> None:
        self.file.close()
