"""A decode attempt's token stream: chunks in arrival order, and the watchdog's
verdicts (deadline, a quiet stream, an instance gone) in their place, on a real
nats-server."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.gateway.stream import StreamEnded, TokenStream
from tests.gateway.served import NatsServer


@pytest.fixture(scope="module")
def natsd():
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture
async def nats_client(natsd):
    nc = await nats.connect(natsd.url)
    yield nc
    await nc.close()


def alive(_iid: str) -> None:
    pass


class Gone(Exception):
    pass


def dead(iid: str) -> None:
    raise Gone(iid)


async def opened(nc, deadline_s: float = 30.0, idle_s: float = 30.0, check=alive) -> TokenStream:
    stream = TokenStream("decode-0", time.time() + deadline_s, idle_s, 0.05, check)
    await stream.open(nc, "yb.test.stream.s1")
    return stream


async def test_chunks_come_in_order_and_the_stream_closes(nats_client):
    stream = await opened(nats_client)
    for i in range(5):
        await nats_client.publish("yb.test.stream.s1", b"%d" % i)
    assert [await asyncio.wait_for(stream.next(), 5) for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
    await stream.close()
    await asyncio.sleep(0)
    assert stream.watchdog is not None and stream.watchdog.done()


@pytest.mark.parametrize("deadline_s, idle_s, check, error", [
    (0.1, 30.0, alive, "deadline exceeded while decoding"),
    (30.0, 0.1, alive, "no token from decode-0 for 0 s"),
])
async def test_the_watchdog_ends_a_stream_past_its_deadline_or_quiet_too_long(nats_client, deadline_s, idle_s, check,
                                                                             error):
    stream = await opened(nats_client, deadline_s, idle_s, check)
    with pytest.raises(StreamEnded, match=error) as e:
        await asyncio.wait_for(stream.next(), 5)
    assert e.value.status == 504
    await stream.close()


async def test_a_quiet_stream_whose_instance_stopped_beating_ends_with_the_liveness_error(nats_client):
    stream = await opened(nats_client, check=dead)
    with pytest.raises(Gone, match="decode-0"):
        await asyncio.wait_for(stream.next(), 5)
    await stream.close()
