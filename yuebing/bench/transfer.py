"""`yuebing bench transfer`: messenger → messenger throughput against memcpy, with
the KV plane plaintext (--kv-insecure) and guarded by the cluster key in both modes
(AES-GCM sealed messages, the default, and ZeroMQ CURVE; both encrypt) in the same
run, so the price of each is read side by side.

Starts nats-server and two real messenger processes (node "a" and node "b") per
block size and mode, then plays a prefill worker on node a: reserves pool slots with node b
as destination, fills them, and announces them written. Node a's messenger checks
each block and streams it to node b, whose messenger copies it into its own pool,
checks it and announces it ready. Throughput is bytes over the time from the first
"written" note to the last "ready" event on node b: the full path a KV block takes.
In the same run it times a plain memcpy of the same bytes, for the ratio, and bare
ZeroMQ PUSH → PULL with and without CURVE: the transport's ceilings.
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
from shared.kv.keys import ClusterKeys, generate_keys, write_keys
from shared.kv.pool_file import Geometry, PoolSlots, checksum
from shared.kv.wire import BlockEvent, Hello, Reserve, Written, event_decoder, events_endpoint
from shared.messages import MessengerCommand, MessengerStats, decode, encode, messenger_subject
from yuebing import process


@dataclass(frozen=True)
class TransferResult:
    block_bytes: int
    blocks: int
    seconds: float  # plaintext
    gbps: float  # GB/s (1e9 bytes) messenger → messenger, plaintext (--kv-insecure)
    memcpy_gbps: float
    ratio: float  # gbps / memcpy_gbps
    zmq_gbps: float  # bare ZeroMQ PUSH → PULL over the same TCP loopback: the transport's ceiling
    aes_gcm_gbps: float  # messenger → messenger with the cluster key, --kv-security aes-gcm (the default)
    aes_gcm_ratio: float  # aes_gcm_gbps / gbps: what it keeps of the plaintext throughput
    curve_gbps: float  # the same with --kv-security curve
    curve_ratio: float  # curve_gbps / gbps
    zmq_curve_gbps: float  # bare ZeroMQ with CURVE


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


def _curve(sock: zmq.Socket, keys: ClusterKeys | None, server: bool) -> None:
    if keys is not None:
        if server:
            sock.curve_server = True
        else:
            sock.curve_serverkey = keys.public
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret


def _pull(endpoint: str, count: int, ready, done, keys: ClusterKeys | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    _curve(sock, keys, server=True)
    sock.bind(endpoint)
    ready.set()
    sock.recv(copy=False)
    start = time.perf_counter()
    for _ in range(count - 1):
        sock.recv(copy=False)
    done.put(time.perf_counter() - start)
    sock.close(0)
    ctx.term()


def zmq_gbps(block_bytes: int, count: int, keys: ClusterKeys | None = None) -> float:
    """Bare ZeroMQ PUSH → PULL between two processes over TCP loopback, no messenger
    (CURVE with `keys`): what any ZeroMQ-based messenger could reach here at best."""
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{process.free_port()}"
    ready, done = mp.Event(), mp.Queue()
    receiver = mp.Process(target=_pull, args=(endpoint, count, ready, done, keys), daemon=True)
    receiver.start()
    ready.wait(30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    _curve(sock, keys, server=False)
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
def two_messengers(work: Path, pool_bytes: int, key_file: Path | None = None,
                   security: str = "aes-gcm") -> Iterator[ClusterConfig]:
    """nats-server and messengers for nodes a and b (with the cluster key in
    `key_file` and `security`, or --kv-insecure without); yields the config."""
    work.mkdir(parents=True, exist_ok=True)
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
                    "--instance-id", f"messenger-{node}", "--node", node,
                    *(["--kv-key-file", str(key_file), "--kv-security", security] if key_file else ["--kv-insecure"])]
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
    """Both modes, one after the other, on the same blocks."""
    blocks = max(4, total_bytes // block_bytes)
    keys = write_keys(work / "kv.key", generate_keys())
    plain = messenger_seconds(block_bytes, blocks, work / "plain", None)
    aes = messenger_seconds(block_bytes, blocks, work / "aes-gcm", work / "kv.key", "aes-gcm")
    curve = messenger_seconds(block_bytes, blocks, work / "curve", work / "kv.key", "curve")
    gbps, aes_gbps, curve_gbps = (blocks * block_bytes / s / 1e9 for s in (plain, aes, curve))
    return TransferResult(
        block_bytes, blocks, plain, gbps, copy_gbps, gbps / copy_gbps, zmq_gbps(block_bytes, blocks),
        aes_gbps, aes_gbps / gbps, curve_gbps, curve_gbps / gbps, zmq_gbps(block_bytes, blocks, keys),
    )


def messenger_seconds(block_bytes: int, blocks: int, work: Path, key_file: Path | None,
                      security: str = "aes-gcm") -> float:
    """From the first "written" note on node a to the last "ready" event on node b."""
    geometry = Geometry(layers=1, shape=(1, 1, block_bytes), dtype="uint8", itemsize=1, layout="bytes")
    pool_bytes = (blocks + 2) * geometry.slot_bytes
    with two_messengers(work, pool_bytes, key_file, security) as config:
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
    return seconds


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
    return [Written(pool_id=reply.pool_id, layer=0, slots=slots.slots[i : i + batch], hashes=hashes[i : i + batch],
                    checksums=sums[i : i + batch])
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
            progress(f"  {_size(size):>8}: plaintext {r.gbps:5.2f} GB/s ({r.ratio:.2f} × memcpy {r.memcpy_gbps:.2f} "
                     f"GB/s), AES-GCM {r.aes_gcm_gbps:5.2f} GB/s ({r.aes_gcm_ratio:.2f} × plaintext), CURVE "
                     f"{r.curve_gbps:5.2f} GB/s ({r.curve_ratio:.2f} ×); bare ZeroMQ {r.zmq_gbps:.2f}, with CURVE "
                     f"{r.zmq_curve_gbps:.2f} GB/s")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def table(results: list[TransferResult]) -> str:
    lines = [
        "| block | blocks | messenger→messenger GB/s, plaintext | AES-GCM (default) | AES-GCM / plaintext | CURVE "
        "| CURVE / plaintext | memcpy GB/s | plaintext / memcpy | bare ZeroMQ TCP GB/s | bare, CURVE "
        "| plaintext messenger / bare |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {_size(r.block_bytes)} | {r.blocks} | {r.gbps:.2f} | {r.aes_gcm_gbps:.2f} "
                     f"| {r.aes_gcm_ratio:.2f} | {r.curve_gbps:.2f} | {r.curve_ratio:.2f} | {r.memcpy_gbps:.2f} "
                     f"| {r.ratio:.2f} | {r.zmq_gbps:.2f} | {r.zmq_curve_gbps:.2f} | {r.gbps / r.zmq_gbps:.2f} |")
    return "\n".join(lines)


def to_json(results: list[TransferResult]) -> dict:
    return {"transport": "zmq-tcp-loopback", "results": [asdict(r) for r in results]}
