"""Pipeline.run over a real nats-server, with the Conductor, prefill and decode
played by responders on their subjects: what the gateway asks each, in which order,
what it streams back, and how it fails."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.gateway.pipeline import ChunkCheck, Lost, Pipeline, Rejected, Report, UpstreamError, kv_expected
from shared import bus
from shared.config import ClusterConfig
from shared.identity import ANY_UPDATES
from shared.liveness import Registry
from services.decode.handler import Chunks
from shared.engine.llm import Step
from shared.messages import (
    CANCEL,
    SCHEDULE,
    Cancel,
    DecodeAccept,
    DecodeRequest,
    Heartbeat,
    Placement,
    PrefillRequest,
    PrefillResult,
    RequestUpdate,
    Sampling,
    ScheduleReply,
    ScheduleRequest,
    TokenBatch,
    TokenChunk,
    UpdateBatch,
    decode_subject,
    encode,
    prefill_subject,
)
from shared.outbox import Outbox
from shared.token_channel import Channels, ChannelServer

PLACEMENT = Placement(conductor="c0", prefill_id="p0", decode_id="d0", decode_node="node-1", kv_blocks=2)
PROMPT = list(range(300))  # two full 128-token blocks


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Path(sys.executable).with_name("nats-server")
    proc = subprocess.Popen([str(server), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


class Cluster:
    """Responders for the Conductor, p0 and d0 that record what they were asked."""

    def __init__(self, nc, placement: Placement = PLACEMENT, prefill_kv_blocks: int = 2, tokens: int = 3,
                 decode_overloaded: bool = False, gap_s: float = 0.0, channelled: Channelled | None = None) -> None:
        self.nc = nc
        self.gap_s = gap_s  # between decode's chunks
        self.channelled = channelled  # decode's chunks over the gateway's token channel, as a decode instance's go
        self.placement = placement
        self.prefill_kv_blocks = prefill_kv_blocks
        self.tokens = tokens
        self.decode_overloaded = decode_overloaded
        self.asked: dict[str, object] = {}
        self.published: list[object] = []

    async def start(self) -> None:
        await bus.subscribe(self.nc, SCHEDULE, ScheduleRequest, self.on_schedule)
        await bus.subscribe(self.nc, prefill_subject("p0"), PrefillRequest, self.on_prefill)
        await bus.subscribe(self.nc, decode_subject("d0"), DecodeRequest, self.on_decode)
        await bus.subscribe(self.nc, ANY_UPDATES, UpdateBatch, self.on_updates)
        await bus.subscribe(self.nc, CANCEL, Cancel, self.on_published)

    async def on_schedule(self, ask: ScheduleRequest, msg) -> None:
        self.asked.setdefault("schedule", ask)
        if {self.placement.prefill_id, self.placement.decode_id} & set(ask.avoid):  # a retry: nowhere else to go
            reply = ScheduleReply(request_id=ask.request_id, accepted=False, rejection="unavailable", reason="no other")
        else:
            reply = ScheduleReply(request_id=ask.request_id, accepted=True, placement=self.placement)
        await msg.respond(encode(reply))

    async def on_prefill(self, ask: PrefillRequest, msg) -> None:
        self.asked["prefill"] = ask
        finish = "length" if ask.sampling.max_tokens == 1 else None  # as prefill ends a one-token request
        result = PrefillResult(request_id=ask.request_id, ok=True, first_token_id=7, num_cached_tokens=128,
                               kv_blocks=self.prefill_kv_blocks, finish_reason=finish)
        await msg.respond(encode(result))

    async def on_decode(self, ask: DecodeRequest, msg) -> None:
        self.asked["decode"] = ask
        accept = DecodeAccept(request_id=ask.request_id, ok=not self.decode_overloaded,
                              overloaded=self.decode_overloaded, error="busy" if self.decode_overloaded else "")
        await msg.respond(encode(accept))
        if self.channelled is not None:
            await self.channelled.decode(ask, self.tokens)
            return
        for seq in range(self.tokens if not self.decode_overloaded else 0):
            last = seq == self.tokens - 1
            chunk = TokenChunk(request_id=ask.request_id, seq=seq, token_ids=[100 + seq],
                               finish_reason="length" if last else None, kv_loaded_tokens=256 if seq == 0 else 0)
            await bus.publish(self.nc, ask.stream_subject, TokenBatch(chunks=[chunk]))
            await asyncio.sleep(self.gap_s)

    async def on_published(self, message, _msg) -> None:
        self.published.append(message)

    async def on_updates(self, batch: UpdateBatch, _msg) -> None:
        self.published.extend(batch.updates)

    async def updates(self, n: int) -> list[object]:
        """The first n updates and cancels, waiting for them (they are fire-and-forget)."""
        async with asyncio.timeout(5):
            while len(self.published) < n:
                await asyncio.sleep(0.01)
        return self.published


class Channelled:
    """Decode's chunks as the decode service sends them (Chunks, the outbox, its
    channels), the gateway's end of the channel closed after `cut_after` of them."""

    def __init__(self, nc, server: ChannelServer, cut_after: int) -> None:
        self.server, self.cut_after = server, cut_after
        self.outbox, self.channels = Outbox(nc), Channels("d0")

    async def decode(self, ask: DecodeRequest, tokens: int) -> None:
        channel = self.channels.get(ask.stream_channel, ask.stream_key)
        await until(lambda: channel.ready)
        chunks = Chunks(ask, self.outbox, lambda: 0.01, channel)
        for seq in range(tokens):
            if seq == self.cut_after:
                await until(lambda: self.server.frames == seq)  # everything so far arrived
                for connection in list(self.server.connections):
                    connection.close()
                await until(lambda: channel.closed)
            chunks.send(Step(token_ids=[100 + seq], finish_reason="length" if seq == tokens - 1 else None,
                             num_cached_tokens=256))
            await self.outbox.flush()


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
async def connected(nats_url):
    nc = await bus.connect(nats_url, name="test")
    config = ClusterConfig(model="/m/tiny", block_size=128, heartbeat_interval_s=0.2, liveness_timeout_s=1.0)
    registry = Registry(timeout_s=config.liveness_timeout_s)
    for iid, role in [("p0", "prefill"), ("d0", "decode")]:
        registry.observe(Heartbeat(instance_id=iid, role=role, node="node-1", pid=1, seq=1, sent_at=0.0), time.monotonic())
    yield nc, Pipeline(nc, config, registry)
    await nc.close()


async def run(pipeline: Pipeline, request_id: str, max_tokens: int = 4, report: Report | None = None) -> list[TokenChunk]:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0)
    return [c async for c in pipeline.run(request_id, PROMPT, sampling, time.time() + 10, report=report)]


async def test_prefill_gives_the_first_token_decode_the_rest_as_placed(connected):
    nc, pipeline = connected
    cluster = Cluster(nc)
    await cluster.start()
    report = Report()
    chunks = await run(pipeline, "r1", report=report)
    assert [t for c in chunks for t in c.token_ids] == [7, 100, 101, 102]
    assert chunks[-1].finish_reason == "length"
    # The prompt is hashed once, by the gateway, and the same hashes reach the Conductor and prefill.
    assert len(cluster.asked["schedule"].block_hashes) == 2
    assert cluster.asked["prefill"].block_hashes == cluster.asked["schedule"].block_hashes
    # Prefill executes the Conductor's placement; decode waits for the blocks prefill sent.
    assert cluster.asked["prefill"].placement == PLACEMENT
    assert (cluster.asked["decode"].first_token_id, cluster.asked["decode"].kv_blocks) == (7, 2)
    assert (report.placement, report.cached_tokens, report.kv_blocks, report.kv_loaded_tokens) == (PLACEMENT, 128, 2, 256)
    [update] = await cluster.updates(1)
    # Its tenant's token quota settles on the prompt and the tokens it streamed.
    assert update == RequestUpdate(request_id="r1", kind="finished", completed=True, tokens=300 + 4)


async def test_a_sink_takes_decodes_ordinary_tokens_past_the_generator_and_the_books_count_them(connected):
    nc, pipeline = connected
    cluster = Cluster(nc, tokens=5, gap_s=0.05)  # the request waits for each chunk: the sink may take it
    await cluster.start()
    sunk: list[TokenChunk] = []
    report = Report()
    sampling = Sampling(max_tokens=6, temperature=0.0)
    chunks = [c async for c in pipeline.run("r1", PROMPT, sampling, time.time() + 10, report=report,
                                            sink=lambda c: sunk.append(c) is None)]
    # Prefill's token, decode's first (it carries what decode loaded) and last (its end) come this way.
    assert [c.token_ids for c in chunks] == [[7], [100], [104]] and chunks[-1].finish_reason == "length"
    assert [c.seq for c in sunk] == [1, 2, 3]
    assert report.streamed_tokens == 6 and report.kv_loaded_tokens == 256
    [update] = await cluster.updates(1)
    assert update == RequestUpdate(request_id="r1", kind="finished", completed=True, tokens=300 + 6)


async def test_chunks_a_sink_leaves_come_through_the_generator(connected):
    nc, pipeline = connected
    cluster = Cluster(nc, tokens=5, gap_s=0.05)
    await cluster.start()
    sampling = Sampling(max_tokens=6, temperature=0.0)
    chunks = [c async for c in pipeline.run("r1", PROMPT, sampling, time.time() + 10, sink=lambda c: False)]
    assert [t for c in chunks for t in c.token_ids] == [7, 100, 101, 102, 103, 104]


async def test_chunks_come_over_the_token_channel_and_over_nats_once_it_closed(connected):
    nc, pipeline = connected
    await pipeline.inbox.channel.start("127.0.0.1")
    channelled = Channelled(nc, pipeline.inbox.channel, cut_after=3)
    cluster = Cluster(nc, tokens=5, channelled=channelled)
    await cluster.start()
    try:
        chunks = await run(pipeline, "r1", max_tokens=6)
    finally:
        await pipeline.inbox.channel.close()
        await channelled.channels.close()
    assert [t for c in chunks for t in c.token_ids] == [7, 100, 101, 102, 103, 104]
    assert (pipeline.inbox.channel.frames, channelled.outbox.channelled, channelled.outbox.batches) == (3, 3, 5)


async def test_decode_waits_only_for_the_blocks_prefills_pool_took(connected):
    nc, pipeline = connected
    cluster = Cluster(nc, prefill_kv_blocks=1)  # the pool had room for one of the two
    await cluster.start()
    await run(pipeline, "r2")
    assert cluster.asked["decode"].kv_blocks == 1


async def test_a_request_that_ends_at_its_first_token_never_reaches_decode(connected):
    nc, pipeline = connected
    cluster = Cluster(nc, placement=Placement(conductor="c0", prefill_id="p0", decode_id="d0", decode_node="node-1", kv_blocks=0))
    await cluster.start()
    chunks = await run(pipeline, "r3", max_tokens=1)
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([7], "length")]
    assert "decode" not in cluster.asked


async def test_a_decode_refusal_is_a_rejection_and_the_conductor_hears_of_the_wasted_prefill(connected):
    nc, pipeline = connected
    cluster = Cluster(nc, decode_overloaded=True)
    await cluster.start()
    with pytest.raises(Rejected) as refused:
        await run(pipeline, "r4")
    assert refused.value.reply.rejection == "overloaded"
    # It was closed before another decode was asked for (none here): then counted as wasted.
    published = await cluster.updates(3)
    assert Cancel(request_id="r4", reason="abandoned by gateway") in published
    assert RequestUpdate(request_id="r4", kind="decode_refused", instance_id="d0") in published


async def test_an_instance_that_stops_beating_fails_the_request_fast(connected):
    nc, pipeline = connected
    pipeline.started -= 10  # long past the start-up grace
    pipeline.registry = Registry(timeout_s=1.0)  # nobody is beating
    await bus.subscribe(nc, SCHEDULE, ScheduleRequest, Cluster(nc).on_schedule)

    async def stalled(_ask, _msg) -> None:  # takes the request and never answers
        pass

    await bus.subscribe(nc, prefill_subject("p0"), PrefillRequest, stalled)
    started = time.monotonic()
    with pytest.raises(UpstreamError) as failed:
        await run(pipeline, "r5")
    assert failed.value.status == 503 and "stopped responding" in str(failed.value)
    assert time.monotonic() - started < 2.0  # one heartbeat interval, not the deadline


async def test_a_gateway_that_stalled_reads_the_heartbeats_it_missed_before_judging_silence(connected):
    # Heartbeats every 0.6 s, judged silent after 1 s; then the gateway's own event
    # loop blocks for 1.6 s. The watcher wakes first, late: the instance was beating
    # all along, and the heartbeat it missed is read before anyone is judged.
    _nc, pipeline = connected
    pipeline.started -= 10
    pipeline.registry = Registry(timeout_s=1.0)
    beat = Heartbeat(instance_id="p0", role="prefill", node="node-0", pid=1, seq=1, sent_at=0.0)

    async def beating() -> None:
        while True:
            pipeline.registry.observe(beat, time.monotonic())
            await asyncio.sleep(0.6)

    async def work() -> str:
        await asyncio.sleep(0.3)
        time.sleep(1.6)  # blocks the loop, as a starved or busy gateway does
        await asyncio.sleep(1.0)
        return "answered"

    beats = asyncio.create_task(beating())
    try:
        assert await pipeline._watch("p0", work(), time.time() + 10) == "answered"
    finally:
        beats.cancel()


def test_decode_waits_for_no_more_blocks_than_prefill_sent():
    assert kv_expected(planned=7, sent=4) == 4  # the pool had no room for the rest
    assert kv_expected(planned=7, sent=7) == 7
    assert kv_expected(planned=7, sent=-1) == 7  # prefill did not say


async def test_a_live_decode_that_goes_quiet_fails_the_request_long_before_its_deadline(connected):
    # Decode accepts and keeps beating, but its tokens never come (a lost chunk).
    nc, pipeline = connected
    pipeline.config = ClusterConfig(model="/m/tiny", block_size=128, heartbeat_interval_s=0.2, token_idle_timeout_s=0.5)
    pipeline.registry = Registry(timeout_s=60.0)  # d0 stays alive throughout: only its stream is quiet
    for iid, role in [("p0", "prefill"), ("d0", "decode")]:
        beat = Heartbeat(instance_id=iid, role=role, node="node-1", pid=1, seq=1, sent_at=0.0)
        pipeline.registry.observe(beat, time.monotonic())
    cluster = Cluster(nc, tokens=0)
    await cluster.start()
    started = time.monotonic()
    with pytest.raises(UpstreamError) as quiet:
        await run(pipeline, "r6")  # a 10 s deadline
    assert quiet.value.status == 504 and "no token from d0" in str(quiet.value)
    assert time.monotonic() - started < 2.0


async def test_a_request_the_engine_refuses_as_invalid_is_a_400_and_not_retried(connected):
    nc, pipeline = connected
    cluster = Cluster(nc)
    await cluster.start()
    asked: list[str] = []

    async def refuses(ask: PrefillRequest, msg) -> None:
        asked.append(ask.request_id)
        await msg.respond(encode(PrefillResult(request_id=ask.request_id, ok=False, invalid=True,
                                               error="prefill failed: grammar backend cannot take the schema")))

    await bus.subscribe(nc, prefill_subject("p1"), PrefillRequest, refuses)
    cluster.placement = Placement(conductor="c0", prefill_id="p1", decode_id="d0", decode_node="node-1", kv_blocks=2)
    pipeline.registry.observe(Heartbeat(instance_id="p1", role="prefill", node="node-1", pid=2, seq=1, sent_at=0.0),
                              time.monotonic())
    with pytest.raises(UpstreamError) as failed:
        await run(pipeline, "r9")
    assert failed.value.status == 400 and "schema" in str(failed.value)
    assert asked == ["r9"]  # nobody else was asked


def test_a_decodes_chunks_are_checked_in_order_and_done_once_every_output_ended():
    check = ChunkCheck("decode-0", n=2)
    check.take(TokenChunk(request_id="a", seq=0, token_ids=[1], index=0))
    check.take(TokenChunk(request_id="a", seq=1, token_ids=[2], index=1, finish_reason="stop"))
    assert not check.done  # output 0 goes on
    check.take(TokenChunk(request_id="a", seq=2, token_ids=[3], index=0, finish_reason="length"))
    assert check.done


def test_a_chunk_out_of_order_was_lost_on_the_way_and_the_decode_is_not_blamed():
    with pytest.raises(Lost) as lost:
        ChunkCheck("decode-0", n=1).take(TokenChunk(request_id="a", seq=1, token_ids=[1]))
    assert lost.value.status == 503 and "out of order: got chunk 1, expected 0" in str(lost.value)


async def test_a_prefill_answer_lost_with_a_nats_server_is_asked_again_of_the_same_instance(connected):
    nc, pipeline = connected
    pipeline.started -= 10
    cluster = Cluster(nc)
    answer, asked = cluster.on_prefill, []

    async def loses_the_first(ask: PrefillRequest, msg) -> None:
        asked.append(ask.request_id)
        if len(asked) > 1:
            return await answer(ask, msg)
        # Its server dies with the answer: p0 reconnects to another, and its next heartbeat says so.
        beat = Heartbeat(instance_id="p0", role="prefill", node="node-1", pid=1, seq=2, sent_at=0.0,
                         reconnected_at=time.time())
        pipeline.registry.observe(beat, time.monotonic())

    cluster.on_prefill = loses_the_first
    await cluster.start()
    started = time.monotonic()
    chunks = await run(pipeline, "r10")
    assert [t for c in chunks for t in c.token_ids] == [7, 100, 101, 102]
    assert asked == ["r10", "r10-a2"]  # p0 again: the Conductor was not told to avoid it
    assert time.monotonic() - started < 2.0  # a heartbeat interval, not prefill_timeout_s


async def test_a_reconnect_before_the_wait_began_loses_nothing(connected):
    _nc, pipeline = connected
    pipeline.started -= 10
    beat = Heartbeat(instance_id="p0", role="prefill", node="node-1", pid=1, seq=2, sent_at=0.0,
                     reconnected_at=time.time() - 0.05)  # its heartbeat arrives while the wait runs
    waiting = time.time()

    async def work() -> str:
        await asyncio.sleep(0.3)
        pipeline.registry.observe(beat, time.monotonic())
        await asyncio.sleep(0.5)
        return "answered"

    assert beat.reconnected_at < waiting
    assert await pipeline._watch("p0", work(), time.time() + 10) == "answered"


@pytest.mark.parametrize("chunk, says", [
    (TokenChunk(request_id="a", seq=0, token_ids=[], error="engine died"), "decode on decode-0 failed: engine died"),
    (TokenChunk(request_id="a", seq=0, token_ids=[1], index=1), "sent output 1 of a request of 1"),
])
def test_a_chunk_out_of_order_failed_or_of_no_output_asked_for_is_a_502(chunk, says):
    with pytest.raises(UpstreamError) as failed:
        ChunkCheck("decode-0", n=1).take(chunk)
    assert failed.value.status == 502 and says in str(failed.value)
