"""`yuebing bench transfer`: messenger → messenger throughput against memcpy and
against Mooncake's Transfer Engine alone, in one run: the messenger over ZeroMQ with
the KV plane plaintext (--kv-insecure) and guarded by the cluster key in both modes
(AES-GCM sealed messages and ZeroMQ CURVE; both encrypt), over plain TCP streams
(`kv_transport: tcp`, the default, AES-GCM sealed batches), and over Mooncake's
Transfer Engine (`kv_transport: mooncake`, its notes sealed with AES-GCM), so the
price of each is read side by side.

Starts nats-server and two real messenger processes (node "a" and node "b") per
block size and mode, then plays a prefill worker on node a: reserves pool slots with node b
as destination, fills them, and announces them written. Node a's messenger checks
each block and streams it to node b, whose messenger copies it into its own pool,
checks it and announces it ready. Throughput is bytes over the time from the first
"written" note to the last "ready" event on node b: the full path a KV block takes.
In the same run it times a plain memcpy of the same bytes, for the ratio, bare
ZeroMQ PUSH → PULL with and without CURVE, and the bare Transfer Engine (TCP here,
write, batches of 16, as Mooncake's transfer_engine_bench runs it): the transports'
ceilings. Where the engine cannot load, its columns read 0 and the reason is printed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
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
    """GB/s are 1e9 bytes a second; "messenger" rows are messenger → messenger."""

    block_bytes: int
    blocks: int
    gbps: float  # the fastest of Yuebing's transports as deployed (the cluster key on): zmq, tcp or mooncake
    mooncake_gbps: float  # the bare Transfer Engine: what Mooncake itself moves here (0: it cannot load)
    ratio_to_mooncake: float  # gbps / mooncake_gbps
    zmq: float  # messenger over ZeroMQ, AES-GCM
    tcp: float  # messenger over plain TCP streams (`kv_transport: tcp`, the default), AES-GCM
    mooncake: float  # messenger over the Transfer Engine, notes sealed with AES-GCM (0: it cannot load)
    zmq_plaintext: float  # messenger over ZeroMQ, --kv-insecure
    zmq_curve: float  # messenger over ZeroMQ, --kv-security curve
    memcpy_gbps: float
    bare_zmq_gbps: float  # bare ZeroMQ PUSH → PULL over the same TCP loopback: that transport's ceiling
    bare_zmq_curve_gbps: float  # bare ZeroMQ with CURVE
    tries: int = 1  # turns each contender (the three transports, the bare engine) had: its best is shown
    # Per transport, CPU seconds each messenger process spent per GB moved: [sender, receiver]
    # (the lowest of its turns). What a node's messenger needs in cores per GB/s of KV.
    cpu_s_per_gb: dict[str, list[float]] = field(default_factory=dict)
    # The same, of each messenger's event-loop thread alone: where its Python runs (the
    # Transfer Engine's and the SSD writer's threads left out).
    loop_s_per_gb: dict[str, list[float]] = field(default_factory=dict)


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
                   security: str = "aes-gcm", transport: str = "zmq"
                   ) -> Iterator[tuple[ClusterConfig, list[subprocess.Popen]]]:
    """nats-server and messengers for nodes a and b (with the cluster key in
    `key_file` and `security`, or --kv-insecure without) over `transport`; yields the
    config and the two messenger processes."""
    work.mkdir(parents=True, exist_ok=True)
    nats_port = process.free_port()
    config = ClusterConfig(nats_url=f"nats://127.0.0.1:{nats_port}", kv_dir=str(work / "kv"), pool_bytes=pool_bytes,
                           log_level="warning", kv_transport=transport)
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
        yield config, messengers
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


def measure(block_bytes: int, total_bytes: int, work: Path, copy_gbps: float, engine: bool,
            tries: int = 1) -> TransferResult:
    """Every transport and mode on the same blocks (`engine`: whether Mooncake's Transfer
    Engine loads here). The contenders (Yuebing's transports as deployed and the bare
    engine) go `tries` times, taking turns, and each keeps its best: this box's
    figures swing by a fifth from one minute to the next, and a turn that a neighbour
    slowed down should count against neither side."""
    blocks = max(4, total_bytes // block_bytes)
    keys = write_keys(work / "kv.key", generate_keys())
    key = work / "kv.key"
    cpu: dict[str, list[float]] = {}  # transport → [sender, receiver, sender's loop, receiver's loop] CPU-s/GB

    def gbps(name: str, key_file: Path | None, security: str = "aes-gcm", transport: str = "zmq") -> float:
        leg = messenger_leg(block_bytes, blocks, work / name, key_file, security, transport)
        gb = blocks * block_bytes / 1e9
        per_gb = [t / gb for t in (*leg.cpu_s, *leg.loop_s)]
        cpu[transport] = [min(a, b) for a, b in zip(cpu[transport], per_gb)] if transport in cpu else per_gb
        return gb / leg.seconds

    contenders: dict[str, Callable[[], float]] = {
        "zmq": lambda: gbps("aes-gcm", key), "tcp": lambda: gbps("tcp", key, transport="tcp"),
    }
    if engine:
        contenders["mooncake"] = lambda: gbps("mooncake", key, transport="mooncake")
        contenders["bare"] = lambda: mooncake_gbps(block_bytes, blocks)
    best = {name: 0.0 for name in ("zmq", "tcp", "mooncake", "bare")}
    for _ in range(tries):
        for name, figure in contenders.items():
            best[name] = max(best[name], figure())
    deployed = dict(cpu)  # the plaintext and CURVE runs below are ZeroMQ too: not the deployed figure
    plain, curve = gbps("plain", None), gbps("curve", key, "curve")
    top = max(best["zmq"], best["tcp"], best["mooncake"])
    return TransferResult(
        block_bytes, blocks, top, best["bare"], top / best["bare"] if best["bare"] else 0.0, best["zmq"], best["tcp"],
        best["mooncake"], plain, curve, copy_gbps, zmq_gbps(block_bytes, blocks), zmq_gbps(block_bytes, blocks, keys),
        tries, {t: v[:2] for t, v in deployed.items()}, {t: v[2:] for t, v in deployed.items()},
    )


@dataclass(frozen=True)
class Leg:
    """One transfer between the two messengers."""

    seconds: float  # from the first "written" note on node a to the last "ready" event on node b
    cpu_s: tuple[float, float]  # CPU seconds messenger a (sender) and b (receiver) spent meanwhile
    loop_s: tuple[float, float]  # the same, of their event-loop (main) threads alone


def cpu_seconds(pid: int, loop_only: bool = False) -> float:
    """CPU time a live process has run so far, every thread (or its main thread, where
    the messenger's event loop runs), from the scheduler's nanosecond counts (Linux
    /proc). Where the kernel keeps none, user plus system clock ticks of the whole
    process (10 ms steps: too coarse for a short transfer)."""
    tasks = [Path(f"/proc/{pid}/task/{pid}")] if loop_only else list(Path(f"/proc/{pid}/task").iterdir())
    try:
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(messengers: list[subprocess.Popen]) -> list[float]:
    """[sender, receiver, sender's loop, receiver's loop] CPU seconds so far."""
    return [cpu_seconds(m.pid) for m in messengers] + [cpu_seconds(m.pid, loop_only=True) for m in messengers]


def messenger_leg(block_bytes: int, blocks: int, work: Path, key_file: Path | None,
                  security: str = "aes-gcm", transport: str = "zmq") -> Leg:
    """`blocks` blocks from node a's pool to node b's, timed, with each side's CPU time."""
    geometry = Geometry(layers=1, shape=(1, 1, block_bytes), dtype="uint8", itemsize=1, layout="bytes")
    pool_bytes = (blocks + 2) * geometry.slot_bytes
    with two_messengers(work, pool_bytes, key_file, security, transport) as (config, messengers):
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
        before = _cpu(messengers)
        start = time.perf_counter()
        for note in notes:
            a.note(note)
        _await_ready(sub, blocks, work)
        seconds = time.perf_counter() - start
        after = _cpu(messengers)
        sub.close(0)
        a.close()
        b.close()
    # A thread that ended meanwhile takes its count with it, and the counts are read a
    # moment apart: never below nothing, and a process never below its own loop thread.
    spent = [max(0.0, a - b) for a, b in zip(after, before)]
    return Leg(seconds, (max(spent[0], spent[2]), max(spent[1], spent[3])), (spent[2], spent[3]))


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


def run(sizes: list[int], total_bytes: int, tries: int = 1, progress=print) -> list[TransferResult]:
    results = []
    copy = memcpy_gbps(min(total_bytes, 256 << 20))  # the same bytes for every block size
    why_not = engine_unavailable()
    if why_not:
        progress(f"  Mooncake Transfer Engine columns read 0: {why_not}")
    for size in sizes:
        work = Path(tempfile.mkdtemp(prefix="yuebing-xfer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        try:
            results.append(measure(size, total_bytes, work, copy, not why_not, tries))
            r = results[-1]
            progress(f"  {_size(size):>8}: messenger over ZeroMQ {r.zmq:5.2f} GB/s, over TCP {r.tcp:5.2f}, "
                     f"over Mooncake TE {r.mooncake:5.2f}"
                     f"; bare Mooncake TE {r.mooncake_gbps:5.2f}; best / bare TE {r.ratio_to_mooncake:.2f}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def table(results: list[TransferResult]) -> str:
    lines = [
        ("| block | blocks | messenger, ZeroMQ (AES-GCM) GB/s | messenger, TCP (AES-GCM) GB/s | messenger, Mooncake TE "
         "GB/s | bare Mooncake TE GB/s | ZeroMQ / bare TE | TCP / bare TE | Mooncake / bare TE | best / bare TE "
         "| ZeroMQ plaintext | ZeroMQ CURVE | memcpy GB/s | bare ZeroMQ TCP | bare ZeroMQ CURVE |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bare = r.mooncake_gbps or float("nan")
        lines.append(f"| {_size(r.block_bytes)} | {r.blocks} | {r.zmq:.2f} | {r.tcp:.2f} | {r.mooncake:.2f} "
                     f"| {r.mooncake_gbps:.2f} | {r.zmq / bare:.2f} | {r.tcp / bare:.2f} | {r.mooncake / bare:.2f} "
                     f"| {r.ratio_to_mooncake:.2f} "
                     f"| {r.zmq_plaintext:.2f} | {r.zmq_curve:.2f} | {r.memcpy_gbps:.2f} | {r.bare_zmq_gbps:.2f} "
                     f"| {r.bare_zmq_curve_gbps:.2f} |")
    return "\n".join(lines)


def cpu_table(results: list[TransferResult]) -> str:
    """CPU seconds per GB moved, each side, per transport (the lowest of its turns):
    every thread of the messenger, and its event-loop thread alone in brackets."""
    transports = sorted({t for r in results for t in r.cpu_s_per_gb})
    lines = ["| block | " + " | ".join(f"{t}: sender, receiver CPU-s/GB (event loop)" for t in transports) + " |",
             "|---|" + "---|" * len(transports)]
    for r in results:
        cells = []
        for t in transports:
            every, loop = r.cpu_s_per_gb.get(t), r.loop_s_per_gb.get(t, [0.0, 0.0])
            cells.append(f"{every[0]:.3f} ({loop[0]:.3f}), {every[1]:.3f} ({loop[1]:.3f})" if every else "-")
        lines.append(f"| {_size(r.block_bytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(runs: list[list[TransferResult]]) -> str:
    """Per block size, the best of Yuebing's transports against the bare engine in every
    run: the lowest ratio, and whether it reached 1.0 in all of them."""
    lines = [f"best / bare Mooncake TE over {len(runs)} runs in a row:"]
    for i, first in enumerate(runs[0]):
        ratios = [run[i].ratio_to_mooncake for run in runs]
        every = "yes" if min(ratios) >= 1.0 else "no"
        lines.append(f"  {_size(first.block_bytes):>8}: {', '.join(f'{r:.2f}' for r in ratios)}"
                     f" (lowest {min(ratios):.2f}; >= 1.0 in every run: {every})")
    return "\n".join(lines)


def to_json(runs: list[list[TransferResult]]) -> dict:
    """The last run's rows, and every run's when there were several."""
    out: dict = {"transport": "tcp-loopback", "results": [asdict(r) for r in runs[-1]]}
    if len(runs) > 1:
        out["runs"] = [[asdict(r) for r in run] for run in runs]
    return out


# --- the bare Transfer Engine ------------------------------------------------------------
ENGINE_BATCH = 16  # writes per batch, as transfer_engine_bench's default
ENGINE_REGION = 64 << 20  # the buffer each side registers; larger runs cycle through it


def engine_unavailable() -> str:
    """Why Mooncake's Transfer Engine cannot load here ("" when it can)."""
    from services.messenger.mooncake_transport import MooncakeUnavailable, load_engine

    try:
        load_engine("127.0.0.1")
    except MooncakeUnavailable as e:
        return str(e)
    return ""


def _engine_region(block_bytes: int, count: int) -> tuple[object, int, int]:
    """A registered-ready anonymous buffer: (the mapping, its address, its size)."""
    import mmap

    from services.messenger.mooncake_transport import address_of

    size = max(block_bytes, min(count * block_bytes, ENGINE_REGION) // block_bytes * block_bytes)
    region = mmap.mmap(-1, size)
    region[:] = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8).tobytes()
    return region, address_of(memoryview(region)), size


def _engine_target(block_bytes: int, count: int, ready, done) -> None:
    from services.messenger.mooncake_transport import load_engine

    engine = load_engine("127.0.0.1", "tcp")
    _mapping, address, size = _engine_region(block_bytes, count)  # kept mapped while registered
    engine.register_memory(address, size)
    ready.put((f"127.0.0.1:{engine.get_rpc_port()}", address))
    done.wait(300)


def mooncake_gbps(block_bytes: int, count: int) -> float:
    """The bare Transfer Engine between two processes over TCP loopback: `count`
    writes of `block_bytes` in batches of ENGINE_BATCH, no messenger."""
    import multiprocessing

    from services.messenger.mooncake_transport import load_engine

    mp = multiprocessing.get_context("spawn")
    ready, done = mp.Queue(), mp.Event()
    target = mp.Process(target=_engine_target, args=(block_bytes, count, ready, done), daemon=True)
    target.start()
    try:
        session, remote = ready.get(timeout=60)
        engine = load_engine("127.0.0.1", "tcp")
        _mapping, local, size = _engine_region(block_bytes, count)  # kept mapped while registered
        engine.register_memory(local, size)
        per_region = size // block_bytes
        offsets = [(i % per_region) * block_bytes for i in range(count)]
        engine.transfer_sync_write(session, local, remote, block_bytes)  # opens the segment: not timed
        start = time.perf_counter()
        for i in range(0, count, ENGINE_BATCH):
            batch = offsets[i : i + ENGINE_BATCH]
            if engine.batch_transfer_sync_write(session, [local + o for o in batch], [remote + o for o in batch],
                                                [block_bytes] * len(batch)) != 0:
                raise RuntimeError("a Transfer Engine write failed in the benchmark")
        return count * block_bytes / (time.perf_counter() - start) / 1e9
    finally:
        done.set()
        target.join(10)
