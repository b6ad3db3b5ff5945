"""Instance.drain over a real nats-server: a stopping instance says so in a heartbeat
at once, lets what runs finish within its timeout, and reports what is still running
for close() to hand on. Every wait has a deadline."""

from __future__ import annotations

import asyncio

import nats
import pytest

from shared.config import ClusterConfig
from shared.instance import Instance
from shared.messages import HEARTBEAT, Heartbeat, decode
from tests.gateway.served import NatsServer


@pytest.fixture
def natsd():
    server = NatsServer().start()
    yield server
    server.stop()


async def draining_beats(instance: Instance, timeout_s: float) -> tuple[int, list[Heartbeat]]:
    """What drain(timeout_s) returns, and the heartbeats heard meanwhile, waiting for
    the draining one. Heard on the instance's own connection, which orders the
    subscription before the beat: on a second connection, subscribed and flushed,
    nats-server here dropped about one beat in 40."""
    beats: list[Heartbeat] = []

    async def on_beat(msg) -> None:
        beats.append(decode(msg.data, Heartbeat))

    sub = await instance.nc.subscribe(HEARTBEAT, cb=on_beat)
    await instance.nc.flush()
    left = await asyncio.wait_for(instance.drain(timeout_s), timeout_s + 5)
    async with asyncio.timeout(5):
        while not any(b.draining for b in beats):
            await asyncio.sleep(0.01)
    await sub.unsubscribe()
    return left, beats


async def new_instance(url: str) -> Instance:
    return Instance("decode", "decode-0", "node-0", ClusterConfig(calibrate_time_model=False), await nats.connect(url))


def test_a_draining_instance_says_so_at_once_and_lets_a_short_request_finish(natsd):
    async def run() -> None:
        instance = await new_instance(natsd.url)
        finished = asyncio.Event()

        async def work() -> None:
            await asyncio.sleep(0.3)
            finished.set()

        instance.run("r1", work())
        left, beats = await draining_beats(instance, timeout_s=5)
        assert left == 0 and finished.is_set() and instance.served_total == 1
        assert beats and beats[0].draining and beats[0].num_running == 1  # sent before the request ended
        await instance.close()
        await instance.nc.close()

    asyncio.run(run())


def test_a_request_longer_than_the_drain_is_left_for_close_to_end(natsd):
    async def run() -> None:
        instance = await new_instance(natsd.url)
        handed_on = []

        async def work() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                handed_on.append(instance.draining)  # what the roles' handlers read to hand it on
                raise

        instance.run("r1", work())
        loop = asyncio.get_running_loop()
        start = loop.time()
        left, _ = await draining_beats(instance, timeout_s=0.5)
        assert left == 1 and 0.4 < loop.time() - start < 3
        await instance.close()
        assert handed_on == [True] and instance.aborted_total == 1 and not instance.requests
        await instance.nc.close()

    asyncio.run(run())


def test_a_drain_with_nothing_running_returns_at_once(natsd):
    async def run() -> None:
        instance = await new_instance(natsd.url)
        loop = asyncio.get_running_loop()
        start = loop.time()
        left, beats = await draining_beats(instance, timeout_s=30)
        assert left == 0 and loop.time() - start < 2 and beats[0].draining
        await instance.nc.close()

    asyncio.run(run())
