"""Decode attempts' token streams: the gateway's inbox routes each batch's chunks to
their attempts, in arrival order; the watchdog's verdicts (deadline, a quiet stream,
an instance gone) come in their place; on a real nats-server."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest
from prometheus_client import CollectorRegistry

from shared.outbox import Outbox
from services.gateway.stream import Inbox, StreamEnded, TokenStream
from shared.liveness import Registry
from shared.messages import Heartbeat, TokenBatch, TokenChunk
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


async def opened(nc, deadline_s: float = 30.0, idle_s: float = 30.0, check=alive, inbox: Inbox | None = None,
                 attempt: str = "a1") -> TokenStream:
    stream = TokenStream("decode-0", time.time() + deadline_s, idle_s, 0.05, check)
    await stream.open(inbox or Inbox("g1"), nc, attempt)
    return stream


def chunk(attempt: str, seq: int) -> TokenChunk:
    return TokenChunk(request_id=attempt, seq=seq, token_ids=[seq])


async def test_chunks_come_in_order_and_the_stream_closes(nats_client):
    stream = await opened(nats_client)
    outbox = Outbox(nats_client)
    for i in range(5):
        outbox.send(stream.inbox.subject, chunk("a1", i))
        if i % 2:
            await outbox.flush()  # some in one batch, some in the next
    assert [(await asyncio.wait_for(stream.next(), 5)).seq for _ in range(5)] == [0, 1, 2, 3, 4]
    assert outbox.chunks == 5 and outbox.batches == 3
    await stream.close()
    await asyncio.sleep(0)
    assert stream.watchdog is not None and stream.watchdog.done()
    assert not stream.inbox.streams


async def test_one_batch_feeds_each_of_its_attempts_and_drops_the_chunks_of_attempts_not_open(nats_client):
    inbox = Inbox("g2")
    one, two = await opened(nats_client, inbox=inbox, attempt="a1"), await opened(nats_client, inbox=inbox, attempt="a2")
    batch = TokenBatch(chunks=[chunk("a1", 0), chunk("gone", 3), chunk("a2", 0), chunk("a1", 1)])
    await nats_client.publish(inbox.subject, msgspec.json.encode(batch))
    assert [(await asyncio.wait_for(one.next(), 5)).seq for _ in range(2)] == [0, 1]
    assert (await asyncio.wait_for(two.next(), 5)).request_id == "a2"
    page = CollectorRegistry()
    page.register(inbox.dropped)
    assert page.get_sample_value("yuebing_gateway_late_chunks_total") == 1
    for stream in (one, two):
        await stream.close()


async def test_a_sink_takes_a_chunk_only_while_the_request_waits_with_nothing_queued():
    stream = TokenStream("decode-0", time.time() + 30, 30.0, 0.05, alive)
    taken: list[int] = []
    stream.sink = lambda c: taken.append(c.seq) is None and c.seq % 2 == 1  # takes the odd ones
    stream.arrived(chunk("a1", 1))  # nobody waits yet: queued, everything before it may be unhandled
    assert (await stream.next()).seq == 1 and taken == []
    waiting = asyncio.create_task(stream.next())
    await asyncio.sleep(0)
    stream.arrived(chunk("a1", 3))  # taken: the request sleeps on
    stream.arrived(chunk("a1", 4))  # left: queued, the request wakes for it
    assert (await asyncio.wait_for(waiting, 5)).seq == 4 and taken == [3, 4]


async def test_a_sink_that_fails_fails_its_own_request_and_takes_nothing_more():
    stream = TokenStream("decode-0", time.time() + 30, 30.0, 0.05, alive)

    def broken(_chunk: TokenChunk) -> bool:
        raise ValueError("broken sink")

    stream.sink = broken
    waiting = asyncio.create_task(stream.next())
    await asyncio.sleep(0)
    stream.arrived(chunk("a1", 1))  # on the inbox's callback: must not raise there
    with pytest.raises(ValueError, match="broken sink"):
        await asyncio.wait_for(waiting, 5)
    assert stream.sink is None


async def test_the_inbox_subscribes_once_per_client(nats_client):
    inbox = Inbox("g3")
    await inbox.listen(nats_client)
    await inbox.listen(nats_client)
    assert inbox.client is nats_client and len(nats_client._subs) == 1


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


async def test_a_stream_outlives_a_stall_of_its_own_gateway():
    # The instance beats every 0.6 s and is judged silent after 1 s; the gateway's
    # event loop then blocks for 1.6 s, and the watchdog wakes before the heartbeat
    # that came meanwhile is read. It judges on its next wake: the stream goes on.
    registry = Registry(timeout_s=1.0)
    beat = Heartbeat(instance_id="decode-0", role="decode", node="node-0", pid=1, seq=1, sent_at=0.0)

    def check(iid: str) -> None:
        if not registry.is_alive(iid, time.monotonic()):
            raise Gone(iid)

    async def beating() -> None:
        while True:
            registry.observe(beat, time.monotonic())
            await asyncio.sleep(0.6)

    beats = asyncio.create_task(beating())
    stream = TokenStream("decode-0", time.time() + 30, 30.0, 0.5, check)
    stream.watchdog = asyncio.create_task(stream._watch())
    try:
        await asyncio.sleep(0.3)
        time.sleep(1.6)  # blocks the loop, as a starved or busy gateway does
        await asyncio.sleep(1.2)
        assert not stream.queue and not stream.watchdog.done()
    finally:
        beats.cancel()
        await stream.close()
