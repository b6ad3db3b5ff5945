"""The SSD tier of a node pool: blocks evicted from DRAM, one file per block.

A file is the block's whole pool slot (header, then the layers), so it describes
itself: after a restart the tier is rebuilt by reading the headers in its folder.
A file is verified against its checksums before it is served; a bad one is deleted,
never served. Capacity is in bytes; the least recently used file goes first.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import structlog

from shared.kv_pool import HEADER_BYTES, Geometry, Header, checksum

log = structlog.get_logger(__name__)
SUFFIX = ".blk"


class SsdTier:
    def __init__(self, path: Path, capacity_bytes: int, geometry: Geometry, model: int) -> None:
        if capacity_bytes < geometry.slot_bytes:
            raise ValueError(f"ssd capacity {capacity_bytes} holds no block of {geometry.slot_bytes} bytes")
        self.path = path
        self.capacity_blocks = capacity_bytes // geometry.slot_bytes
        self.geometry = geometry
        self.model = model
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.dropped = 0  # files that failed verification
        path.mkdir(parents=True, exist_ok=True)
        self._scan()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def hashes(self) -> list[bytes]:
        return list(self.lru)

    def put(self, block_hash: bytes, slot: memoryview) -> list[bytes]:
        """Write a block (its whole slot); returns the blocks removed to make room."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return []
        target = self._file(block_hash)
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(slot)
        os.replace(tmp, target)  # a crash leaves no half-written block under the real name
        self.lru[block_hash] = None
        removed = []
        while len(self.lru) > self.capacity_blocks:
            old, _ = self.lru.popitem(last=False)
            self._file(old).unlink(missing_ok=True)
            removed.append(old)
        return removed

    def read(self, block_hash: bytes) -> tuple[bytes, list[int]] | None:
        """The block's slot bytes and layer checksums, verified; None (and the file
        deleted) when it is missing or damaged."""
        if block_hash not in self.lru:
            return None
        try:
            data = self._file(block_hash).read_bytes()
            header = self._check_header(data[:HEADER_BYTES], len(data), block_hash)
            g = self.geometry
            for layer, expected in enumerate(header.layer_checksums):
                start = g.layer_offset(layer)
                if checksum(memoryview(data)[start : start + g.layer_bytes]) != expected:
                    raise ValueError(f"layer {layer} checksum mismatch")
        except (OSError, ValueError) as e:
            self._drop(block_hash, str(e))
            return None
        self.lru.move_to_end(block_hash)
        return data, header.layer_checksums

    def _check_header(self, head: bytes, size: int, block_hash: bytes) -> Header:
        if size != self.geometry.slot_bytes:
            raise ValueError(f"size {size}, expected {self.geometry.slot_bytes}")
        header = Header.unpack(head, self.geometry.itemsize, self.geometry.layout)
        if header.block_hash != block_hash or header.model != self.model or header.geometry != self.geometry:
            raise ValueError("header does not match this pool's blocks")
        return header

    def _scan(self) -> None:
        """Find the blocks a previous run left, oldest first (by modification time)."""
        files = sorted(self.path.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for f in files:
            try:
                block_hash = bytes.fromhex(f.stem)
                with open(f, "rb") as fh:
                    head = fh.read(HEADER_BYTES)
                self._check_header(head, f.stat().st_size, block_hash)
            except (OSError, ValueError) as e:
                log.warning("ssd block dropped", file=f.name, error=str(e))
                self.dropped += 1
                f.unlink(missing_ok=True)
                continue
            self.lru[block_hash] = None
        for tmp in self.path.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        log.info("ssd tier", path=str(self.path), blocks=len(self.lru), capacity_blocks=self.capacity_blocks)

    def _drop(self, block_hash: bytes, why: str) -> None:
        log.warning("ssd block dropped", block=block_hash.hex()[:16], error=why)
        self.dropped += 1
        self.lru.pop(block_hash, None)
        self._file(block_hash).unlink(missing_ok=True)

    def _file(self, block_hash: bytes) -> Path:
        return self.path / f"{block_hash.hex()}{SUFFIX}"
