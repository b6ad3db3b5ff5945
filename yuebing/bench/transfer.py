"""`yuebing bench transfer`: messenger → messenger throughput against memcpy.

Starts nats-server and two real messenger processes (node "a" and node "b") per
block size, then plays a prefill worker on node a: reserves pool slots with node b
as destination, fills them, and announces them written. Node a's messenger checks
each block and streams it to node b, whose messenger copies it into its own pool,
checks it and announces it ready. Throughput is bytes over the time from the first
"written" note to the last "ready" event on node b: the full path a KV block takes.
In the same run it times a plain memcpy of the same bytes, for the ratio.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import zmq

from shared.config import ClusterConfig, save_config
from shared.kv.client import MessengerClient
from shared.kv.pool_file import Geometry, PoolSlots, checksum
from shared.kv.wire import BlockEvent, Hello, Reserve, Written, event_decoder, events_endpoint
from shared.messages import MessengerCommand, MessengerStats, decode, encode, messenger_subject
from yuebing import process


@dataclass(frozen=True)
class TransferResult:
    block_bytes: int
    blocks: int
    seconds: float
    gbps: float  # GB/s (1e9 bytes) messenger → messenger
    memcpy_gbps: float
    ratio: float  # gbps / memcpy_gbps
    zmq_gbps: float  # bare ZeroMQ PUSH → PULL over the same TCP loopback: the transport's ceiling


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Best-of-`repeats` bandwidth of one large copy (numpy → memcpy)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _pull(endpoint: str, count: int, ready, done) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    ready.set()
    sock.recv(copy=False)
    start = time.perf_counter()
    for _ in range(count - 1):
        sock.recv(copy=False)
    done.put(time.perf_counter() - start)
    sock.close(0)
    ctx.term()


def zmq_gbps(block_bytes: int, count: int) -> float:
    """Bare ZeroMQ PUSH → PULL between two processes over TCP loopback, no messenger:
    what any ZeroMQ-based messenger could reach on this machine at best."""
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{process.free_port()}"
    ready, done = mp.Event(), mp.Queue()
    receiver = mp.Process(target=_pull, args=(endpoint, count, ready, done), daemon=True)
    receiver.start()
    ready.wait(30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    payload = np.random.default_rng(2).integers(0, 255, block_bytes, dtype=np.uint8).tobytes()
    for _ in range(count):
        sock.send(payload, copy=False)
    seconds = done.get(timeout=120)
    receiver.join(10)
    sock.close(0)
    ctx.term()
    return (count - 1) * block_bytes / seconds / 1e9


@contextmanager
def two_messengers(work: Path, pool_bytes: int) -> Iterator[ClusterConfig]:
    """nats-server and messengers for nodes a and b; yields the config."""
    nats_port = process.free_port()
    config = ClusterConfig(nats_url=f"nats://127.0.0.1:{nats_port}", kv_dir=str(work / "kv"), pool_bytes=pool_bytes,
                           log_level="warning")
    config_path = work / "cluster.json"
    save_config(config, config_path)
    nats_bin = Path(sys.executable).with_name("nats-server")
    nats = process.spawn([str(nats_bin), "-a", "127.0.0.1", "-p", str(nats_port)], work / "nats.log")
    messengers = []
    try:
        process.wait_for_port(nats_port, timeout_s=10)
        for node in ("a", "b"):
            argv = [sys.executable, "-m", "services.messenger", "--config", str(config_path),
                    "--instance-id", f"messenger-{node}", "--node", node]
            messengers.append(process.spawn(argv, work / f"messenger-{node}.log"))
        yield config
    finally:
        process.stop(messengers, grace_s=10.0)
        process.stop([nats], grace_s=10.0)


async def _stats(nats_url: str, node: str) -> MessengerStats:
    import nats

    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(messenger_subject(node), encode(MessengerCommand(op="stats")), timeout=2)
        return decode(msg.data, MessengerStats)
    finally:
        await nc.close()


def wait_for_peer(config: ClusterConfig, timeout_s: float = 30.0) -> None:
    """Until node a's messenger knows where node b's is (from b's heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if "b" in asyncio.run(_stats(config.nats_url, "a")).peers:
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError("messenger a never saw messenger b")


def hello(client: MessengerClient, geometry: Geometry, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = client.call(Hello(geometry=geometry, model="bench"))
        if reply is not None:
            if not reply.ok:
                raise RuntimeError(reply.error)
            return reply
        time.sleep(0.2)
    raise RuntimeError("messenger did not answer hello")


def measure(block_bytes: int, total_bytes: int, work: Path, copy_gbps: float) -> TransferResult:
    blocks = max(4, total_bytes // block_bytes)
    geometry = Geometry(layers=1, shape=(1, 1, block_bytes), dtype="uint8", itemsize=1, layout="bytes")
    pool_bytes = (blocks + 2) * geometry.slot_bytes
    with two_messengers(work, pool_bytes) as config:
        kv = config.kv_root
        a, b = MessengerClient(kv, "a", timeout_s=5), MessengerClient(kv, "b", timeout_s=5)
        reply = hello(a, geometry)
        hello(b, geometry)
        wait_for_peer(config)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events_endpoint(kv, "b"))
        time.sleep(0.3)  # SUB sockets miss what is published before they are connected
        notes = _fill(a, reply, geometry, blocks)
        start = time.perf_counter()
        for note in notes:
            a.note(note)
        _await_ready(sub, blocks, work)
        seconds = time.perf_counter() - start
        sub.close(0)
        a.close()
        b.close()
    gbps = blocks * block_bytes / seconds / 1e9
    bare = zmq_gbps(block_bytes, blocks)
    return TransferResult(block_bytes, blocks, seconds, gbps, copy_gbps, gbps / copy_gbps, bare)


def _fill(a: MessengerClient, reply, geometry: Geometry, blocks: int) -> list[Written]:
    """Reserve `blocks` slots in node a's pool bound for node b and fill them, as a
    prefill worker does; the "written" notes that hand them over, about 4 MiB each."""
    hashes = [secrets.token_bytes(16) for _ in range(blocks)]
    slots = a.call(Reserve(owner="bench", hashes=hashes, dest="b"))
    if slots is None or any(s < 0 for s in slots.slots):
        raise RuntimeError("no room in the pool")
    block_bytes = geometry.layer_bytes  # one layer: the whole block
    pool = PoolSlots.open(reply.pool_path, geometry, reply.pool_slots)
    payload = np.random.default_rng(1).integers(0, 255, block_bytes, dtype=np.uint8).tobytes()
    sums = []
    for slot in slots.slots:
        pool.layer(slot, 0)[:] = payload
        sums.append(checksum(pool.layer(slot, 0)))
    pool.close()
    batch = max(1, (4 << 20) // block_bytes)
    return [Written(pool_id=reply.pool_id, layer=0, slots=slots.slots[i : i + batch], checksums=sums[i : i + batch])
            for i in range(0, blocks, batch)]


def _await_ready(sub: zmq.Socket, blocks: int, work: Path) -> None:
    """Until node b's messenger has announced every block ready."""
    ready = 0
    while ready < blocks:
        if not sub.poll(30_000):
            raise RuntimeError(f"only {ready}/{blocks} blocks arrived; see {work}/messenger-*.log")
        event: BlockEvent = event_decoder.decode(sub.recv())
        if event.kind == "ready":
            ready += len(event.hashes)
        elif event.kind == "failed":
            raise RuntimeError("a block failed its checksum in the benchmark")


def run(sizes: list[int], total_bytes: int, progress=print) -> list[TransferResult]:
    results = []
    copy = memcpy_gbps(min(total_bytes, 256 << 20))  # the same bytes for every block size
    for size in sizes:
        work = Path(tempfile.mkdtemp(prefix="yuebing-xfer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        try:
            results.append(measure(size, total_bytes, work, copy))
            r = results[-1]
            progress(f"  {_size(size):>8}: {r.gbps:6.2f} GB/s  ({r.ratio:.2f} × memcpy {r.memcpy_gbps:.2f} GB/s; "
                     f"bare ZeroMQ {r.zmq_gbps:.2f} GB/s)")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def table(results: list[TransferResult]) -> str:
    lines = [
        "| block | blocks | messenger→messenger GB/s | memcpy GB/s | ratio | bare ZeroMQ TCP GB/s | messenger / bare |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {_size(r.block_bytes)} | {r.blocks} | {r.gbps:.2f} | {r.memcpy_gbps:.2f} | {r.ratio:.2f} "
                     f"| {r.zmq_gbps:.2f} | {r.gbps / r.zmq_gbps:.2f} |")
    return "\n".join(lines)


def to_json(results: list[TransferResult]) -> dict:
    return {"transport": "zmq-tcp-loopback", "results": [asdict(r) for r in results]}
