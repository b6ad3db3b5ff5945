"""A messenger that restarts under running engines (issue 16): its engines attach
again by themselves. A real messenger service (its sockets and loops, no NATS, no
transport) runs on an event loop thread; the engine side is the real client, pool
follower and worker half. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch

from services.messenger.app import LocalSockets, MessengerService
from services.messenger.messenger import Messenger
from services.messenger.node_pool import NodePool, PoolOptions
from shared.kv.client import MessengerClient, PoolFollower
from shared.kv.meta import YuebingMeta
from shared.kv.options import Options
from shared.kv.plan import Save
from shared.kv.wire import Release, Reserve
from shared.kv.worker import ConnectorWorker
from tests.messenger.nodes import Recorder

NODE = "n"
BLOCKS = 4


class Quiet(Recorder):
    """No other messenger ever sends, nothing ever waits for a peer: receive, watch and
    backlog wait forever."""

    async def receive(self) -> tuple[bytes, memoryview]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def watch(self) -> None:
        await asyncio.Event().wait()

    async def backlog(self) -> None:
        await asyncio.Event().wait()


class Served:
    """A messenger as app.main serves it, on its own event loop thread."""

    def __init__(self, kv_dir: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.svc: MessengerService = self._run(self._start(kv_dir))

    async def _start(self, kv_dir: str) -> MessengerService:
        messenger = Messenger(NODE, kv_dir, PoolOptions(pool_bytes=1 << 20), transport=Quiet())
        svc = MessengerService(messenger, LocalSockets(kv_dir, NODE))
        svc.start()
        return svc

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    @property
    def pool(self) -> NodePool | None:
        pool = self.svc.messenger.pool
        return pool if isinstance(pool, NodePool) else None

    def crash(self) -> None:
        """Gone as if killed: its loops and sockets stop, its pool file stays behind."""
        async def stop() -> None:
            await self.svc.close()
            self.svc.sockets.close()
        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    def stop(self) -> None:
        self.crash()
        self.svc.messenger.close()


def until(check: Callable[[], object], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def worker(kv_dir: str) -> tuple[ConnectorWorker, dict[str, torch.Tensor]]:
    opts = Options(kv_dir=kv_dir, node=NODE, block_size=4, salt=b"s", model="m")
    w = ConnectorWorker(opts, BLOCKS)
    caches = {f"layer.{i}": torch.randn(2, BLOCKS, 2, 4, 8) for i in range(3)}
    w.register_kv_caches(caches)
    return w, caches


def test_a_restarted_messenger_is_attached_again_and_takes_blocks_without_an_engine_restart(tmp_path):
    kv_dir = str(tmp_path / "kv")
    first = Served(kv_dir)
    w, caches = worker(kv_dir)
    client = MessengerClient(kv_dir, NODE)  # the scheduler half's
    follower = PoolFollower(kv_dir, NODE, client)
    second: Served | None = None
    try:
        assert w.pool is not None and first.pool is not None
        old_id = first.pool.pool_id
        until(lambda: follower.pool_id == old_id and follower.alive, "the first pool followed")
        first.crash()
        until(lambda: not follower.alive, "the dead messenger noticed")
        second = Served(kv_dir)  # a new pool file; nobody says hello at start-up any more
        until(lambda: second.pool is not None, "the worker's watch to carve the new pool")
        new_id = second.pool.pool_id
        assert new_id != old_id
        until(lambda: follower.pool_id == new_id and follower.alive, "the new pool followed")
        # The scheduler half's next reservation lands in the new pool; the worker maps
        # its new file when the step names it, and the block arrives whole.
        block = b"b" * 16
        reply = client.call(Reserve(owner="r", hashes=[block]))
        assert reply is not None and reply.pool_id == new_id and reply.slots[0] >= 0
        meta = YuebingMeta(pool_id=new_id, saves=[Save(block_id=1, slot=reply.slots[0], block_hash=block)])
        for name in caches:
            w.save_kv_layer(meta, name)
        assert w.pool is not None and w.pool.pool_id == new_id
        until(lambda: block in follower.ready, "the saved block ready in the new pool")
        client.note(Release(owner="r"))
    finally:
        follower.close()
        client.close()
        w.shutdown()
        if second is not None:
            second.stop()
