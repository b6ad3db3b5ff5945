"""Wiring of a messenger: config → NATS (heartbeat, peers, commands) → the node's
local sockets and the transport → `Messenger`."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio

from services.messenger.messenger import Messenger
from services.messenger.transport import ZmqTransport
from shared import bus, service
from shared.config import ClusterConfig
from shared.instance import Instance
from shared.kv_wire import (
    BlockEvent,
    Reply,
    control_decoder,
    control_encoder,
    control_endpoint,
    events_endpoint,
    note_decoder,
    written_endpoint,
)
from shared.liveness import Registry
from shared.messages import HEARTBEAT, Heartbeat, MessengerCommand, encode, messenger_subject

log = structlog.get_logger(__name__)
TICK_S = 0.25  # how often engines hear that we are alive


def parser() -> argparse.ArgumentParser:
    p = service.parser("messenger", instance=True)
    p.add_argument("--host", default="127.0.0.1", help="address other messengers reach this one on")
    p.add_argument("--port", type=int, default=0, help="transfer port (0: any free port)")
    p.add_argument("--advertise-host", default="", help="the name peers use to reach --host (default: --host)")
    return p


class LocalSockets:
    """The three IPC sockets the node's engines talk to (see shared/kv_wire.py)."""

    def __init__(self, kv_dir: str, node: str) -> None:
        Path(kv_dir).mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.asyncio.Context()
        self.control = self._bind(zmq.ROUTER, control_endpoint(kv_dir, node))
        self.written = self._bind(zmq.PULL, written_endpoint(kv_dir, node))
        self.events = self._bind(zmq.PUB, events_endpoint(kv_dir, node))

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
    def __init__(self, config: ClusterConfig, node: str, messenger: Messenger, sockets: LocalSockets) -> None:
        self.config = config
        self.node = node
        self.messenger = messenger
        self.sockets = sockets
        self.registry = Registry(config.liveness_timeout_s)
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("control", self._control_once), ("notes", self._notes_once),
            ("transfer", self._transfer_once), ("tick", self._tick_once),
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
            reply = self.messenger.control(control_decoder.decode(body))
        except msgspec.DecodeError as e:
            reply = Reply(ok=False, error=f"bad control message: {e}")
        await self.sockets.control.send_multipart([identity, empty, control_encoder.encode(reply)])

    async def _notes_once(self) -> None:
        body = await self.sockets.written.recv()
        self.messenger.note(note_decoder.decode(body))

    async def _transfer_once(self) -> None:
        header, payload = await self.messenger.transport.receive()
        self.messenger.received(header, payload)

    async def _tick_once(self) -> None:
        await asyncio.sleep(TICK_S)
        self.messenger.events.append(BlockEvent(kind="tick", pool_id=self.messenger.pool_id))

    async def _flush_events(self) -> None:
        for event in self.messenger.take_events():
            await self.sockets.events.send(control_encoder.encode(event))

    async def on_heartbeat(self, hb: Heartbeat, _msg: object) -> None:
        if hb.role != "messenger" or not hb.endpoint or hb.node == self.node:
            return
        if self.messenger.peers.get(hb.node) != hb.endpoint:
            log.info("peer messenger", node=hb.node, endpoint=hb.endpoint)
            self.messenger.peers[hb.node] = hb.endpoint
            self.messenger.transport.connect(hb.endpoint)
        self.registry.observe(hb, time.monotonic())

    async def on_command(self, cmd: MessengerCommand, msg: object) -> None:
        if cmd.op == "fault":
            self.messenger.corrupt_next = max(0, cmd.corrupt_next)
            log.warning("fault injection armed", corrupt_next=cmd.corrupt_next)
        await msg.respond(encode(self.messenger.stats()))  # type: ignore[attr-defined]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    transport = ZmqTransport(args.host, args.port, args.advertise_host)
    messenger = Messenger(args.node, config.kv_root, config.pool_bytes, transport, config.kv_stream_layers)
    sockets = LocalSockets(config.kv_root, args.node)
    svc = MessengerService(config, args.node, messenger, sockets)
    svc.start()
    nc = await bus.connect(config.nats_url, name=args.instance_id)
    instance = Instance("messenger", args.instance_id, args.node, config, nc)
    instance.endpoint = transport.endpoint
    await bus.subscribe(nc, HEARTBEAT, Heartbeat, svc.on_heartbeat)
    await bus.subscribe(nc, messenger_subject(args.node), MessengerCommand, svc.on_command)
    await instance.start()
    log.info("messenger ready", node=args.node, endpoint=transport.endpoint, kv_dir=config.kv_root)
    await stop.wait()
    await instance.close()
    await svc.close()
    await bus.close(nc)
    sockets.close()
    transport.close()
    messenger.close()
