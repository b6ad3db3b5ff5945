"""Wiring of a messenger: config → NATS (heartbeat, peers, commands, the fault
switch) → the node's local sockets and the transport → `Messenger`.

The KV plane is authenticated unless asked otherwise: a messenger without the
cluster's key file (--kv-key-file, shared/kv/keys.py) refuses to start, unless it is
given --kv-insecure. Fault injection is off unless --fault-injection is given."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.messenger import metrics
from services.messenger.messenger import Messenger
from services.messenger.mooncake_transport import MooncakeTransport, MooncakeUnavailable
from services.messenger.node_pool import PoolOptions
from services.messenger.pool import EVICTION_POLICIES
from services.messenger.tcp_transport import TcpTransport
from services.messenger.transport import KV_SECURITY, Transport, ZmqTransport
from shared import bus, service, tracing
from shared.config import ClusterConfig
from shared.instance import Instance
from shared.kv.keys import KEY_FILE_ENV, ClusterKeys, load_keys
from shared.kv.wire import (
    Control,
    Pin,
    Reply,
    control_decoder,
    control_encoder,
    control_endpoint,
    events_endpoint,
    note_decoder,
    written_endpoint,
)
from shared.messages import (
    HEARTBEAT,
    KV_EVENTS,
    Heartbeat,
    Message,
    MessengerAck,
    MessengerCommand,
    encode,
    messenger_faults_subject,
    messenger_subject,
)
from shared.private_file import private_dir
from shared.service import freeze_heap

log = structlog.get_logger(__name__)
TICK_S = 0.25  # how often engines hear that we are alive
DRAIN_MAX = 256  # layers taken in one go before the other loops get a turn
DRAIN_S = 0.002  # and at most this long: engines hear of the blocks that are in, heartbeats go out
# KV events for the Conductor go out joined, at most this often: one NATS message per
# burst of layers cost the receiving messenger a write and nats-server a wake-up each.
KV_EVENTS_S = 0.05


def parser() -> argparse.ArgumentParser:
    p = service.parser("messenger", instance=True)
    p.add_argument("--host", default="127.0.0.1", help="address other messengers reach this one on")
    p.add_argument("--port", type=int, default=0, help="transfer port (0: any free port)")
    p.add_argument("--advertise-host", default="", help="the name peers use to reach --host (default: --host)")
    p.add_argument("--pool-bytes", type=int, help="DRAM pool size (default: the config's pool_bytes)")
    p.add_argument("--eviction", choices=EVICTION_POLICIES, help="default: the config's (lru)")
    p.add_argument("--ssd-path", help="folder of the SSD tier (default: <config ssd_dir>/<node> if ssd_dir is set)")
    p.add_argument("--ssd-bytes", type=int, help="SSD tier size (default: the config's ssd_bytes)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")
    p.add_argument("--kv-key-file", default=os.environ.get(KEY_FILE_ENV),
                   help=f"the cluster's KV key file, owner-only (default: ${KEY_FILE_ENV}); "
                   "required unless --kv-insecure")
    p.add_argument("--kv-security", choices=KV_SECURITY, default="aes-gcm",
                   help="how the key guards the KV plane: AES-GCM sealed messages, or CURVE connections "
                   "(both encrypt; `yuebing bench transfer` measures them)")
    p.add_argument("--kv-insecure", action="store_true",
                   help="no key: any peer may put blocks into this node's pool (tests only)")
    p.add_argument("--fault-injection", action="store_true",
                   help="obey fault commands (corrupt layers, refuse reservations): tests and drills only")
    return p


def cluster_keys(args: argparse.Namespace) -> ClusterKeys | None:
    """The KV plane's keys; None only when --kv-insecure asks for no authentication."""
    if args.kv_key_file:
        try:
            return load_keys(args.kv_key_file)
        except ValueError as e:
            raise SystemExit(f"messenger: {e}") from e
    if not args.kv_insecure:
        raise SystemExit(f"messenger: --kv-key-file (or ${KEY_FILE_ENV}) is required; "
                         "--kv-insecure runs without one, letting anyone who reaches the port plant KV blocks")
    log.warning("kv plane unauthenticated (--kv-insecure): any peer may put blocks into this pool")
    return None


class LocalSockets:
    """The three IPC sockets the node's engines talk to (see shared/kv/wire.py)."""

    def __init__(self, kv_dir: str, node: str) -> None:
        private_dir(kv_dir, repair=True)  # nobody else may connect to these sockets
        self.ctx = zmq.asyncio.Context()
        self.control = self._bind(zmq.ROUTER, control_endpoint(kv_dir, node))
        self.written = self._bind(zmq.PULL, written_endpoint(kv_dir, node))
        self.events = self._bind(zmq.PUB, events_endpoint(kv_dir, node))
        # The same socket without futures: a PUB send never blocks, so it needs no
        # future and no trip through the loop, once per burst of layers.
        self.events_now = zmq.Socket.shadow(self.events.underlying)

    def _bind(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return sock

    def close(self) -> None:
        for sock in (self.control, self.written, self.events):
            sock.close(0)
        self.ctx.term()


class MessengerService:
    def __init__(self, messenger: Messenger, sockets: LocalSockets, owns_process: bool = False) -> None:
        self.messenger = messenger
        self.sockets = sockets
        self.owns_process = owns_process  # the process is the messenger's alone (see freeze_heap), not a test's
        self.tasks: list[asyncio.Task[None]] = []
        self.nc: Client | None = None
        self._sends = itertools.count()  # pin owners of sends (pulls from other nodes)
        self._reading: dict[bytes, asyncio.Event] = {}  # blocks being read back from SSD
        self._kv_sent_at = float("-inf")

    def start(self) -> None:
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("control", self._control_once), ("notes", self._notes_once),
            ("transfer", self._transfer_once), ("tick", self._tick_once), ("peers", self._peers_once),
            ("backlog", self.messenger.node.transport.backlog),  # then the loop flushes what waits
        ]
        self.tasks = [asyncio.create_task(self._forever(name, step), name=name) for name, step in loops]

    async def _forever(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad message must not stop the loop
                log.exception("messenger loop error", loop=name)
            await self._flush_events()

    async def _control_once(self) -> None:
        identity, empty, body = await self.sockets.control.recv_multipart()
        try:
            message = control_decoder.decode(body)
        except msgspec.DecodeError as e:
            reply = Reply(ok=False, error=f"bad control message: {e}")
        else:
            if isinstance(message, Pin):
                await self._read_from_ssd(message.owner, message.hashes)
            reply = self.answer(message)
        await self.sockets.control.send_multipart([identity, empty, control_encoder.encode(reply)])

    def answer(self, message: Control) -> Reply:
        """An engine's call answered; the Hello that carves the pool also freezes the heap."""
        carved = self.messenger.carved
        reply = self.messenger.control(message)
        if not carved and self.messenger.carved and self.owns_process:
            # The pool's slot objects (a few tracked containers per block) made each full
            # collection a pause of tens of ms in the middle of transfers (one of 40-55 ms
            # inside a GiB moved in 64 KiB blocks).
            freeze_heap()
        return reply

    async def _read_from_ssd(self, owner: str, hashes: list[bytes]) -> None:
        """Bring the SSD-only blocks of a pin or a send into DRAM on a thread first: a
        70B block is tens of MiB, and reading it inline would stall transfers and
        heartbeats. The run's blocks stay pinned for `owner` (the request, whose
        Release frees them; a send, which frees them when done)."""
        reads = self.messenger.ssd_reads(owner, hashes)
        for read in reads:
            self._reading[read.block_hash] = asyncio.Event()
        try:
            for read in reads:
                read.finish(await asyncio.to_thread(read.load))
                self._reading.pop(read.block_hash).set()
        finally:  # cancelled: whoever waits on the rest stops waiting
            for read in reads:
                if (done := self._reading.pop(read.block_hash, None)) is not None:
                    done.set()
        # Blocks another pin or send is reading back right now: wait for those reads
        # rather than find the blocks still filling and compute them.
        for block_hash in hashes:
            if (reading := self._reading.get(block_hash)) is not None:
                await reading.wait()

    async def _notes_once(self) -> None:
        body = await self.sockets.written.recv()
        self.messenger.note(note_decoder.decode(body))

    async def _transfer_once(self) -> None:
        """One layer, then those already here behind it (up to DRAIN_MAX, for at most
        DRAIN_S), before the loop flushes the events they made: one wake-up and one
        event per burst."""
        transport = self.messenger.node.transport
        self.messenger.received(*await transport.receive())
        deadline = time.monotonic() + DRAIN_S
        for _ in range(DRAIN_MAX):
            message = transport.receive_nowait()
            if message is None:
                return
            self.messenger.received(*message)
            if time.monotonic() > deadline:
                return

    async def _peers_once(self) -> None:
        await self.messenger.node.transport.watch()  # counts and logs a refused peer

    async def _tick_once(self) -> None:
        await asyncio.sleep(TICK_S)
        self.messenger.upkeep(time.monotonic())
        self.messenger.node.block_event("tick", self.messenger.pool.pool_id, [])

    async def _flush_events(self) -> None:
        """The layers this step queued go out, the engines hear what changed at once;
        the Conductor hears it at most every KV_EVENTS_S, joined (or at the next tick)."""
        node = self.messenger.node
        node.flush()
        for event in node.take_events():
            self.sockets.events_now.send(control_encoder.encode(event), zmq.NOBLOCK)
        now = time.monotonic()
        if self.nc is not None and node.kv_events and now - self._kv_sent_at >= KV_EVENTS_S:
            self._kv_sent_at = now
            for kv in node.take_kv_events():
                await bus.publish(self.nc, KV_EVENTS, kv)

    async def on_heartbeat(self, hb: Heartbeat, _msg: object) -> None:
        if hb.role == "messenger":
            self.messenger.node.meet(hb.node, hb.endpoint, time.monotonic())

    async def on_command(self, cmd: MessengerCommand, msg: Msg) -> None:
        try:
            hashes = [bytes.fromhex(h) for h in cmd.hashes]
        except ValueError:
            await msg.respond(encode(MessengerAck(ok=False, error="hashes must be hex")))
            return
        if cmd.op == "snapshot":
            reply: Message = self.messenger.snapshot()
        elif cmd.op == "send":
            owner = f"send-{next(self._sends)}"
            # Within the trace of the prefill that asked for it (its context came in the headers).
            with tracing.span("messenger.send", owner, node=self.messenger.node.name, to_node=cmd.node,
                              blocks=len(hashes) - cmd.skip):
                await self._read_from_ssd(owner, hashes[cmd.skip:])
                reply = MessengerAck(ok=True, blocks=self.messenger.send_to(cmd.node, hashes, cmd.skip, owner))
        elif cmd.op == "fault":
            faults = messenger_faults_subject(self.messenger.node.name)
            reply = MessengerAck(ok=False, error=f"fault commands go to {faults}")
        else:
            reply = self.messenger.stats()
        await self._flush_events()
        await msg.respond(encode(reply))

    async def on_faults(self, cmd: MessengerCommand, msg: Msg) -> None:
        """The fault switch, on a subject of its own that NATS opens to the admin only."""
        if cmd.op != "fault":
            reply: Message = MessengerAck(ok=False, error=f"only fault commands here, not {cmd.op!r}")
        else:
            reply = self.messenger.arm_faults(cmd.corrupt_next, cmd.no_room_next)
        await msg.respond(encode(reply))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def pool_options(config: ClusterConfig, args: argparse.Namespace) -> PoolOptions:
    ssd_path = args.ssd_path or (str(Path(config.ssd_dir) / args.node) if config.ssd_dir else "")
    return PoolOptions(
        pool_bytes=args.pool_bytes or config.pool_bytes,
        eviction=args.eviction or config.eviction,
        ssd_path=ssd_path,
        ssd_bytes=args.ssd_bytes if args.ssd_bytes is not None else config.ssd_bytes,
        stream_layers=config.kv_stream_layers,
        lease_s=config.kv_pin_lease_s,
        ssd_queue_bytes=config.ssd_queue_bytes,
    )


KV_TRANSPORTS = ("zmq", "tcp", "mooncake")


def kv_transport(config: ClusterConfig, args: argparse.Namespace) -> Transport:
    """ZeroMQ, plain TCP streams, or Mooncake's Transfer Engine with ZeroMQ for its
    notes; a messenger asked for what cannot run here stops at once, saying why."""
    if config.kv_transport not in KV_TRANSPORTS:
        raise SystemExit(f"messenger: kv_transport must be one of {', '.join(KV_TRANSPORTS)}, "
                         f"not {config.kv_transport!r}")
    if config.kv_transport == "tcp":
        if args.kv_security != "aes-gcm":
            raise SystemExit("messenger: kv_transport tcp seals with AES-GCM only; --kv-security curve needs zmq")
        return TcpTransport(args.host, args.port, args.advertise_host, keys=cluster_keys(args))
    notes = ZmqTransport(args.host, args.port, args.advertise_host, keys=cluster_keys(args),
                         security=args.kv_security)
    if config.kv_transport == "zmq":
        return notes
    try:
        return MooncakeTransport(notes, args.advertise_host or args.host)
    except MooncakeUnavailable as e:
        notes.close()
        raise SystemExit(f"messenger: --kv-transport mooncake: {e}") from e


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    transport = kv_transport(config, args)
    messenger = Messenger(args.node, config.kv_root, pool_options(config, args), transport,
                          fault_injection=args.fault_injection, peer_forget_s=config.kv_peer_forget_s)
    sockets = LocalSockets(config.kv_root, args.node)
    svc = MessengerService(messenger, sockets, owns_process=True)
    svc.start()
    if args.metrics_port:
        metrics.serve(messenger.stats, messenger.security, args.metrics_port, args.host, upkeep=messenger.upkeep_stats)
    nc = await bus.connect(config.nats_url, args.instance_id, args.nats_credentials)
    svc.nc = nc
    instance = Instance("messenger", args.instance_id, args.node, config, nc)
    instance.endpoint = transport.endpoint
    await bus.subscribe(nc, HEARTBEAT, Heartbeat, svc.on_heartbeat)
    await bus.subscribe(nc, messenger_subject(args.node), MessengerCommand, svc.on_command)
    await bus.subscribe(nc, messenger_faults_subject(args.node), MessengerCommand, svc.on_faults)
    await instance.start()
    log.info("messenger ready", node=args.node, endpoint=transport.endpoint, kv_dir=config.kv_root,
             kv_authenticated=transport.authenticated, kv_security=args.kv_security, kv_transport=config.kv_transport,
             fault_injection=args.fault_injection)
    await stop.wait()
    await instance.close()
    await svc.close()
    await bus.close(nc)
    sockets.close()
    transport.close()
    messenger.close()
