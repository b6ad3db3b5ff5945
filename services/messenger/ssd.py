"""The SSD tier of a node pool: blocks evicted from DRAM, one file per block.

A file is the block's whole pool slot (header, then the layers), so it describes
itself: after a restart the tier is rebuilt by reading the headers in its folder.
A file is verified against its checksums before it is served; a bad one is deleted,
never served. Capacity is in bytes; the least recently used file goes first.

Disk work of a spill happens on a writer thread, not on the messenger's event loop
(a 70B model's block is tens of MiB: a synchronous write would stall transfers and
heartbeats). A spill copies the slot first, since DRAM reuses it at once, and a block
whose write is still queued is served from that copy. A read goes from the file
straight into its DRAM slot (`load`, which the messenger runs on a thread).

The writer's queue is bounded (`queue_bytes` of copies waiting for the disk): a
spill that finds it full is skipped (counted in `skipped`) and its block is simply
evicted, so a slow disk costs cache hits, never unbounded memory.

The folder is owner-only (0700) and its files 0600, created with O_EXCL|O_NOFOLLOW
and read with O_NOFOLLOW: a block file is KV cache, as sensitive as the pool.
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from shared.kv.pool_file import HEADER_BYTES, Geometry, Header, checksum
from shared.private_file import new_private_file, private_dir

log = structlog.get_logger(__name__)
SUFFIX = ".blk"
DEFAULT_QUEUE_BYTES = 256 << 20


class SsdTier:
    def __init__(self, path: Path, capacity_bytes: int, geometry: Geometry, model: int,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if capacity_bytes < geometry.slot_bytes:
            raise ValueError(f"ssd capacity {capacity_bytes} holds no block of {geometry.slot_bytes} bytes")
        self.path = path
        self.capacity_blocks = capacity_bytes // geometry.slot_bytes
        self.geometry = geometry
        self.model = model
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.dropped = 0  # files that failed verification
        self.skipped = 0  # spills not made: the writer's queue was full
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0  # copies handed to the writer and not written yet (under _lock)
        # Spilled blocks whose file is not written yet; the writer thread removes them.
        self.pending: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        # One thread: files are written and unlinked in the order they were asked for.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ssd-writer")
        private_dir(path, repair=True)
        self._scan()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def hashes(self) -> list[bytes]:
        return list(self.lru)

    def put(self, block_hash: bytes, slot: memoryview) -> list[bytes] | None:
        """Write a block (its whole slot); returns the blocks removed to make room, or
        None when the writer's queue is full and the block is not kept. One spill is
        always let in, however big, so a tiny bound never turns the tier off."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return []
        with self._lock:
            if self.queued_bytes and self.queued_bytes + len(slot) > self.queue_bytes:
                self.skipped += 1
                return None
            self.queued_bytes += len(slot)
        data = bytes(slot)  # the DRAM slot gets a new block as soon as this returns
        with self._lock:
            self.pending[block_hash] = data
        self._writer.submit(self._write, block_hash, data)
        self.lru[block_hash] = None
        removed = []
        while len(self.lru) > self.capacity_blocks:
            old, _ = self.lru.popitem(last=False)
            self._forget(old)
            removed.append(old)
        return removed

    def flush(self) -> None:
        """Wait until every spill asked for so far is on disk."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes (a restart finds them) and stop the writer."""
        self._writer.shutdown(wait=True)

    def _write(self, block_hash: bytes, data: bytes) -> None:
        try:
            self._write_file(block_hash, data)
        finally:
            with self._lock:
                self.queued_bytes -= len(data)

    def _write_file(self, block_hash: bytes, data: bytes) -> None:
        target = self._file(block_hash)
        tmp = target.with_suffix(".tmp")
        try:
            with os.fdopen(new_private_file(tmp, os.O_WRONLY), "wb") as f:
                f.write(data)
            os.replace(tmp, target)  # a crash leaves no half-written block under the real name
        except OSError as e:  # disk full or gone: the block stays readable from memory until forgotten
            log.warning("ssd write failed", block=block_hash.hex()[:16], error=str(e))
            return
        with self._lock:
            if self.pending.get(block_hash) is data:  # not spilled again since
                del self.pending[block_hash]

    def _forget(self, block_hash: bytes) -> None:
        """Its file goes (after any write of it still queued)."""
        with self._lock:
            self.pending.pop(block_hash, None)
        self._writer.submit(self._file(block_hash).unlink, missing_ok=True)

    def load(self, block_hash: bytes, slot: memoryview) -> list[int] | None:
        """Read a block back into `slot` (a DRAM slot being filled), from its file or
        its queued spill, and verify it: its layer checksums. Safe on another thread
        (it touches no LRU state; `settle` does, after). None when the file is gone
        (forgotten meanwhile); raises ValueError (or OSError) when it is damaged."""
        with self._lock:
            data = self.pending.get(block_hash)
        if data is not None:
            size = len(data)
            slot[:] = data  # a copy of a slot: the same size
        else:
            try:
                with _open_file(self._file(block_hash)) as f:
                    size = os.fstat(f.fileno()).st_size
                    got = 0
                    while got < len(slot) and (n := f.readinto(slot[got:])):
                        got += n
            except FileNotFoundError:
                return None
        header = self._check_header(bytes(slot[:HEADER_BYTES]), size, block_hash)
        g = self.geometry
        for layer, expected in enumerate(header.layer_checksums):
            start = g.layer_offset(layer)
            if checksum(slot[start : start + g.layer_bytes]) != expected:
                raise ValueError(f"layer {layer} checksum mismatch")
        return header.layer_checksums

    def settle(self, block_hash: bytes, found: list[int] | None | Exception) -> list[int] | None:
        """After `load`, on the tier's own thread: a block read back is recently used;
        a damaged one (`found` is its error) is deleted, never served."""
        if isinstance(found, Exception):
            if block_hash in self.lru:
                self._drop(block_hash, str(found))
            return None
        if found is not None and block_hash in self.lru:
            self.lru.move_to_end(block_hash)
        return found

    def _check_header(self, head: bytes, size: int, block_hash: bytes) -> Header:
        if size != self.geometry.slot_bytes:
            raise ValueError(f"size {size}, expected {self.geometry.slot_bytes}")
        header = Header.unpack(head, self.geometry.itemsize, self.geometry.layout)
        if header.block_hash != block_hash or header.model != self.model or header.geometry != self.geometry:
            raise ValueError("header does not match this pool's blocks")
        return header

    def _scan(self) -> None:
        """Find the blocks a previous run left, oldest first (by modification time)."""
        files = sorted(self.path.glob(f"*{SUFFIX}"), key=lambda p: p.lstat().st_mtime)
        for f in files:
            try:
                block_hash = bytes.fromhex(f.stem)
                with _open_file(f) as fh:
                    head = fh.read(HEADER_BYTES)
                    size = os.fstat(fh.fileno()).st_size
                self._check_header(head, size, block_hash)
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
        self._forget(block_hash)

    def _file(self, block_hash: bytes) -> Path:
        return self.path / f"{block_hash.hex()}{SUFFIX}"


def _open_file(path: Path) -> io.FileIO:
    """A block file for reading; a symlink in its place is an error (ELOOP), not followed."""
    return io.FileIO(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
