"""The worker half's copy machinery: a layer's KV blocks moved between an engine's
cache and the node pool without stalling the forward. No vLLM here: the connector's
worker half (shared/kv/worker.py) wraps it, and `yuebing bench connector` drives it
from a plain torch forward.

Saves. The forward thread hands a layer over as soon as the model has written it, and
goes on at once:
- on a GPU (`StreamCopier`), a copy stream waits for the layer on the GPU (an event,
  never the host), gathers the step's blocks of that layer in one kernel and copies
  them into their pool slots, which are registered with CUDA (pinned), so the copies
  are DMA that overlaps the next layers' compute;
- on a CPU (`ThreadCopier`), a copy thread does the same with plain copies.
A completion thread waits for each layer's copies to land, checksums the slots' bytes
(on several threads, off the forward path) and only then reports the layer saved: the
messenger never streams bytes still in flight.

Loads. Each layer's blocks are copied from their pool slots into vLLM's blocks, layer
after layer, with one event per layer; `wait_layer` makes the compute stream wait on
that event (GPU: the host never waits for bytes), or the forward thread wait for the
copy thread (CPU).

How a GPU's bytes cross (COPY_PATHS), measured on an H200 (docs/benchmarks/connector.md):
loads go by `dma`, one copy-engine transfer per run of consecutive slots, called on the
CUDA runtime directly (42-49 GB/s; one torch copy per block spends ~15 µs of Python
each: 15-37 GB/s). Saves go by `blocks`, one torch copy per block: the 2-D transfers
slowed a 2k-token forward by 14-20 %, the per-block copies by 3 %.

vLLM's source blocks. A block saved in one step may be freed and handed to another
request in the next. `flush`, at the end of every step, makes the next step's work
wait until every gather of this step has read its blocks (GPU: on the GPU, after one
gather kernel per layer; CPU: until the copy thread has copied them).
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from shared.kv.pool_file import Geometry, PoolSlots, checksum

log = structlog.get_logger(__name__)

WAIT_S = 30.0  # the longest any wait here lasts: a copy that has not landed by then never will
# Below this a layer's checksums are summed on one thread: handing them to others costs
# more than a core sums in the time (xxh3: 7-23 GB/s a core, so 4 MiB is 0.2-0.6 ms).
PARALLEL_SUM_BYTES = 4 << 20


def blocks_first(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A layer's KV cache as a view with vLLM blocks in dim 0. vLLM's logical layout
    puts blocks there, possibly split into kernel blocks; older layouts (e.g.
    FlashAttention's (2, blocks, ...)) elsewhere."""
    if cache.shape[0] == num_blocks:
        return cache
    if cache.shape[0] % num_blocks == 0:
        return cache.unflatten(0, (num_blocks, -1))
    return cache.movedim(list(cache.shape).index(num_blocks), 0)


def geometry_of(caches: list[torch.Tensor], layers: int = 0) -> Geometry:
    """One pool block of these (blocks-first) layer caches, of `layers` layers in all
    (default: these)."""
    block = caches[0][0]
    shape = (int(torch.tensor(block.shape[:-2]).prod()), block.shape[-2], block.shape[-1])
    order = sorted(range(caches[0].dim()), key=lambda d: -caches[0].stride(d))
    return Geometry(
        layers=layers or len(caches),
        shape=shape,
        dtype=str(block.dtype).removeprefix("torch."),
        itemsize=block.element_size(),
        layout="dims" + "".join(map(str, order)),
    )


@dataclass
class MappedPool:
    """The node's pool as this process maps it; registered with CUDA (`pin`) where
    copies to and from a GPU use it, so they run as DMA and never through a bounce buffer."""

    pool_id: str
    slots: PoolSlots
    data: torch.Tensor  # the whole file, as bytes
    pinned: bool = False

    @staticmethod
    def of(pool_id: str, slots: PoolSlots) -> MappedPool:
        return MappedPool(pool_id, slots, torch.frombuffer(slots.view, dtype=torch.uint8))

    def layer(self, slot: int, layer: int, dtype: torch.dtype) -> torch.Tensor:
        g = self.slots.geometry
        start = slot * g.slot_bytes + g.layer_offset(layer)
        return self.data[start : start + g.layer_bytes].view(dtype)

    def pin(self) -> None:
        err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        if int(err) != 0:
            if (runtime := cuda_runtime()) is not None:
                runtime.clear_error()  # else the next kernel launch reports it, and fails
            raise RuntimeError(f"cudaHostRegister of the node pool failed (error {int(err)})")
        self.pinned = True

    def holds(self, slots: list[int]) -> bool:
        """Whether every slot is inside the pool: checked before a GPU copy, which would
        read or write past it unchecked."""
        count = self.data.numel() // self.slots.geometry.slot_bytes
        if slots and (min(slots) < 0 or max(slots) >= count):
            log.error("kv copy refused: slot outside the pool", pool=self.pool_id, slots=count,
                      lowest=min(slots), highest=max(slots))
            return False
        return True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        del self.data
        self.slots.close()


class CudaRuntime:
    """The CUDA runtime calls torch does not expose, on the runtime library torch loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._copy_rows = lib.cudaMemcpy2DAsync
        self._copy_rows.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._copy_rows.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.restype = ctypes.c_int

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int) -> None:
        """`rows` rows of `width` bytes, each pitch apart, on the copy engine (cudaMemcpyDefault: UVA tells the ends)."""
        if err := self._copy_rows(dst, dst_pitch, src, src_pitch, width, rows, 4, stream):
            raise RuntimeError(f"cudaMemcpy2DAsync failed (error {err})")

    def clear_error(self) -> None:
        """Reset the runtime's last error (a failed call leaves it for the next launch to find)."""
        self._last_error()


@functools.cache
def cuda_runtime() -> CudaRuntime | None:
    """The CUDA runtime this process's torch loaded, or None where it can't be found."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
    try:
        return CudaRuntime(ctypes.CDLL(path)) if path else None
    except (OSError, AttributeError) as e:
        log.warning("CUDA runtime not usable for KV copies", path=path, error=str(e))
        return None


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Each run of consecutive slots: (its position in `slots`, its first slot, its length)."""
    out: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if out and slot == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((position, slot, 1))
    return out


def dma_rows(runtime: CudaRuntime, pool: MappedPool, staged: torch.Tensor, layer: int, slots: list[int],
             stream: torch.cuda.Stream, to_pool: bool) -> None:
    """Move the slots' parts of `layer` (a slot apart) to or from `staged`'s blocks (side
    by side): one copy-engine transfer per run of consecutive slots, no GPU cores."""
    g = pool.slots.geometry
    part, far0, near0 = g.layer_bytes, pool.data.data_ptr() + g.layer_offset(layer), staged.data_ptr()
    if not staged.is_contiguous() or staged[0].numel() * staged.element_size() != part:
        raise ValueError(f"staged blocks are not {part}-byte parts side by side")
    for position, first, count in runs(slots):
        far, near = far0 + first * g.slot_bytes, near0 + position * part
        if to_pool:
            runtime.copy_rows(far, g.slot_bytes, near, part, part, count, stream.cuda_stream)
        else:
            runtime.copy_rows(near, part, far, g.slot_bytes, part, count, stream.cuda_stream)


@dataclass(frozen=True)
class LayerSave:
    """One layer of one step's saves: vLLM blocks → their pool slots."""

    layer: int  # the model's layer number: its place in a pool block
    block_ids: list[int]
    slots: list[int]


@dataclass(frozen=True)
class LayerLoad:
    """One step's loads: pool slots → vLLM blocks, for every layer."""

    block_ids: list[int]
    slots: list[int]


Noted = Callable[[list[int]], None]  # a layer's copies landed in the pool: its checksums, slot by slot


class Lane:
    """A thread that runs the work handed to it, in order. `drain` waits, bounded,
    until it has run everything handed over so far; a failing piece is logged and
    the lane goes on."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], object]) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(work)

    def drain(self, timeout_s: float = WAIT_S) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=WAIT_S)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            try:
                work()
            except Exception:
                log.exception("kv copy work failed", lane=self._thread.name)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


@dataclass
class LoadJob:
    """A step's loads in flight: per layer, a flag set once that layer is copied
    (CPU) or its copies are queued behind `events[i]` (GPU)."""

    layers: int
    issued: list[threading.Event] = field(init=False)
    events: list[object] = field(init=False)  # GPU: one torch.cuda.Event per layer
    failed: bool = False

    def __post_init__(self) -> None:
        self.issued = [threading.Event() for _ in range(self.layers)]
        self.events = [None] * self.layers

    def give_up(self) -> None:
        self.failed = True
        for flag in self.issued:
            flag.set()

    def wait(self, index: int) -> bool:
        """Whether layer `index` was issued (in time, and without a failure)."""
        return self.issued[index].wait(WAIT_S) and not self.failed


def gather(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The step's blocks of one (blocks-first) layer cache, side by side: one kernel,
    and each block's K and V end up contiguous, as a pool slot's layer part holds them."""
    return cache.index_select(0, ids)


def to_slots(pool: MappedPool, staged: torch.Tensor, layer: int, slots: list[int], non_blocking: bool) -> None:
    for block, slot in zip(staged, slots):
        pool.layer(slot, layer, staged.dtype).view(block.shape).copy_(block, non_blocking=non_blocking)


def from_slots(pool: MappedPool, staged: torch.Tensor, layer: int, slots: list[int], non_blocking: bool) -> None:
    for block, slot in zip(staged, slots):
        block.copy_(pool.layer(slot, layer, staged.dtype).view(block.shape), non_blocking=non_blocking)


def staging(cache: torch.Tensor, blocks: int) -> torch.Tensor:
    return torch.empty((blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)


def checksum_all(views: list[memoryview]) -> list[int]:
    return [checksum(view) for view in views]


class Copier:
    """Saves and loads between layer caches and the pool, off the forward path. The
    forward thread calls `save`, `load`, `wait_layer` and `flush`; the copies land on
    a copy lane (CPU) or copy streams (GPU); `done` follows each up once it landed."""

    def __init__(self, checksum_threads: int = 0) -> None:
        self._threads = checksum_threads or min(8, os.cpu_count() or 1)
        self._sums = ThreadPoolExecutor(self._threads, thread_name_prefix="yuebing-checksum")
        self.done = Lane("yuebing-completions")

    def adopt(self, pool: MappedPool) -> None:
        """Ready a newly mapped pool for this copier's copies (nothing to do on a CPU)."""

    def checksums(self, pool: MappedPool, layer: int, slots: list[int]) -> list[int]:
        """The slots' layer parts, checksummed on several threads if they are large
        (xxh3 lets go of the GIL). Each thread takes a run of slots, not one: a future
        per slot takes the GIL thousands of times a forward, and a GPU engine's forward
        thread then waits for it (a 2k-token save cost 8-49 % more on an H100)."""
        views = [pool.slots.layer(slot, layer) for slot in slots]
        groups = min(self._threads, len(views) * pool.slots.geometry.layer_bytes // PARALLEL_SUM_BYTES)
        if groups < 2:
            return checksum_all(views)
        size = -(-len(views) // groups)
        parts = self._sums.map(checksum_all, [views[at : at + size] for at in range(0, len(views), size)])
        return [value for part in parts for value in part]

    def save(self, pool: MappedPool, cache: torch.Tensor, job: LayerSave, noted: Noted) -> None:
        raise NotImplementedError

    def flush(self) -> bool:
        """The end of a step: the next step's work cannot touch a block before this
        step's saves have read it. False if that could not be made sure in time."""
        raise NotImplementedError

    def load(self, pool: MappedPool, caches: list[torch.Tensor], layers: list[int], job: LayerLoad,
             released: Callable[[], None]) -> LoadJob:
        """Start copying `job`'s slots into every layer's blocks; `released` runs once
        every copy has landed (or failed), when the slots may be reused."""
        raise NotImplementedError

    def wait_layer(self, load: LoadJob, index: int) -> bool:
        raise NotImplementedError

    def settle(self, timeout_s: float = WAIT_S) -> bool:
        """Wait until everything handed over has landed and been followed up (noted, released)."""
        return self.flush() and self.done.drain(timeout_s)

    def close(self) -> None:
        self.done.close()
        self._sums.shutdown(wait=False)


class ThreadCopier(Copier):
    """CPU engines: a copy thread gathers and copies; the forward thread hands over."""

    def __init__(self, checksum_threads: int = 0) -> None:
        super().__init__(checksum_threads)
        self.copies = Lane("yuebing-copy")

    def save(self, pool: MappedPool, cache: torch.Tensor, job: LayerSave, noted: Noted) -> None:
        def copy() -> None:
            to_slots(pool, gather(cache, torch.tensor(job.block_ids)), job.layer, job.slots, non_blocking=False)
            self.done.submit(lambda: noted(self.checksums(pool, job.layer, job.slots)))

        self.copies.submit(copy)

    def flush(self) -> bool:
        return self.copies.drain()

    def load(self, pool: MappedPool, caches: list[torch.Tensor], layers: list[int], job: LayerLoad,
             released: Callable[[], None]) -> LoadJob:
        load = LoadJob(len(caches))
        ids = torch.tensor(job.block_ids)

        def copy_all() -> None:  # one piece of work: the forward waits on each layer's flag, not on the lane
            try:
                for index, cache in enumerate(caches):
                    staged = staging(cache, len(job.slots))
                    from_slots(pool, staged, layers[index], job.slots, non_blocking=False)
                    cache.index_copy_(0, ids, staged)
                    load.issued[index].set()
            except Exception:
                load.give_up()
                raise
            finally:
                released()

        self.copies.submit(copy_all)
        return load

    def wait_layer(self, load: LoadJob, index: int) -> bool:
        return load.wait(index)

    def close(self) -> None:
        self.copies.close()
        super().close()


def landed(event: object, poll_s: float = 0.0002) -> bool:
    """Poll a CUDA event until its work is done (bounded): the completion thread never
    blocks inside CUDA, so closing never hangs on it."""
    deadline = time.monotonic() + WAIT_S
    while not event.query():  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


COPY_PATHS = ("dma", "blocks")


class StreamCopier(Copier):
    """GPU engines: copies on their own streams, ordered after the compute stream by
    events; the forward thread only enqueues them, and the host never waits for bytes.
    `saves` and `loads` each cross by `dma` (the copy engine, one transfer per run of
    consecutive slots) or `blocks` (one torch copy per block, also what `dma` falls
    back to where the CUDA runtime can't be called or the pool isn't pinned)."""

    def __init__(self, device: torch.device, checksum_threads: int = 0, saves: str = "blocks",
                 loads: str = "dma") -> None:
        super().__init__(checksum_threads)
        if saves not in COPY_PATHS or loads not in COPY_PATHS:
            raise ValueError(f"copy paths are {' or '.join(COPY_PATHS)}; got saves={saves!r}, loads={loads!r}")
        self.device, self.saves_by, self.loads_by = device, saves, loads
        self.runtime = cuda_runtime() if "dma" in (saves, loads) else None
        self.save_stream = torch.cuda.Stream(device)
        self.load_stream = torch.cuda.Stream(device)
        self.loads = Lane("yuebing-load")  # issues a step's loads while the forward starts
        self._gathered: torch.cuda.Event | None = None  # the last gather: flush waits for it
        self._ids: tuple[tuple[int, ...], torch.Tensor] | None = None  # this step's block ids, on the GPU

    def adopt(self, pool: MappedPool) -> None:
        """Pin the pool, so that copies to and from it are DMA the host never waits for."""
        try:
            pool.pin()
        except RuntimeError as e:  # still correct, but each copy then waits on the host
            log.warning("node pool not pinned: KV copies stall the forward", error=str(e))

    def path(self, pool: MappedPool, wanted: str) -> str:
        """How copies to and from this pool cross: `wanted`, where the pool and runtime allow it."""
        return "dma" if wanted == "dma" and self.runtime is not None and pool.pinned else "blocks"

    def _on_device(self, block_ids: list[int]) -> torch.Tensor:
        """The block ids as a GPU tensor, made once per step and copied without a host sync."""
        key = tuple(block_ids)
        if self._ids is None or self._ids[0] != key:
            ids = torch.tensor(key, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            self._ids = (key, ids)
        return self._ids[1]

    def save(self, pool: MappedPool, cache: torch.Tensor, job: LayerSave, noted: Noted) -> None:
        if not pool.holds(job.slots):
            return  # never noted: the messenger gives the slots up at its deadline
        ids = self._on_device(job.block_ids)
        ids.record_stream(self.save_stream)  # its memory is not reused before the gather has read it
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))  # right after the model wrote this layer
        with torch.cuda.stream(self.save_stream):
            self.save_stream.wait_event(written)
            staged = gather(cache, ids)
            self._gathered = torch.cuda.Event()
            self._gathered.record(self.save_stream)
            self._write(pool, staged, job)
            copied = torch.cuda.Event()
            copied.record(self.save_stream)

        def follow_up() -> None:
            if not landed(copied):
                raise TimeoutError(f"layer {job.layer}'s copies did not land in {WAIT_S} s")
            noted(self.checksums(pool, job.layer, job.slots))
            del staging_alive[:]  # the staging buffer goes back to the allocator only now

        staging_alive = [staged]
        self.done.submit(follow_up)

    def _write(self, pool: MappedPool, staged: torch.Tensor, job: LayerSave) -> None:
        """On the save stream: the gathered blocks into their slots."""
        if self.path(pool, self.saves_by) == "dma":
            dma_rows(self.runtime, pool, staged, job.layer, job.slots, self.save_stream, to_pool=True)
        else:
            to_slots(pool, staged, job.layer, job.slots, non_blocking=True)

    def flush(self) -> bool:
        if self._gathered is not None:
            torch.cuda.current_stream(self.device).wait_event(self._gathered)
        return True

    def load(self, pool: MappedPool, caches: list[torch.Tensor], layers: list[int], job: LayerLoad,
             released: Callable[[], None]) -> LoadJob:
        load = LoadJob(len(caches))
        if not pool.holds(job.slots):
            load.give_up()
            self.done.submit(released)
            return load
        ids = self._on_device(job.block_ids)
        ids.record_stream(self.load_stream)
        start = torch.cuda.Event()
        # The blocks to fill are free once the compute stream's earlier work (and the ids' copy) is done.
        start.record(torch.cuda.current_stream(self.device))
        self.load_stream.wait_event(start)
        if self._gathered is not None:
            self.load_stream.wait_event(self._gathered)

        def issue_all() -> None:
            try:
                for index, cache in enumerate(caches):
                    # The current device and stream are per thread: this lane's are set here.
                    with torch.cuda.device(self.device), torch.cuda.stream(self.load_stream):
                        self._read(pool, cache, layers[index], job, ids)
                        load.events[index] = torch.cuda.Event()
                        load.events[index].record(self.load_stream)  # type: ignore[attr-defined]
                    load.issued[index].set()
            except Exception:
                load.give_up()
                raise
            finally:
                last = next((e for e in reversed(load.events) if e is not None), None)
                self.done.submit(lambda: (last is None or landed(last)) and released())

        self.loads.submit(issue_all)
        return load

    def _read(self, pool: MappedPool, cache: torch.Tensor, layer: int, job: LayerLoad, ids: torch.Tensor) -> None:
        """On the load stream: one layer's slots into its blocks."""
        staged = staging(cache, len(job.slots))
        if self.path(pool, self.loads_by) == "dma":
            dma_rows(self.runtime, pool, staged, layer, job.slots, self.load_stream, to_pool=False)
        else:
            from_slots(pool, staged, layer, job.slots, non_blocking=True)
        cache.index_copy_(0, ids, staged)

    def wait_layer(self, load: LoadJob, index: int) -> bool:
        if not load.wait(index):
            return False
        torch.cuda.current_stream(self.device).wait_event(load.events[index])  # the GPU waits, not the host
        return True

    def close(self) -> None:
        self.loads.close()
        super().close()


def copier_for(device: torch.device, checksum_threads: int = 0, saves: str = "blocks", loads: str = "dma") -> Copier:
    """The copier for caches on `device` (`saves`, `loads`: how a GPU's bytes cross, COPY_PATHS)."""
    if device.type == "cuda":
        return StreamCopier(device, checksum_threads, saves, loads)
    return ThreadCopier(checksum_threads)
