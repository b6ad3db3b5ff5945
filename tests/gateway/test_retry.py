"""Retry and migration (services/gateway/retry.py): the pure parts, then Pipeline.run
over a real nats-server with a fleet of stand-in instances that can stall, refuse,
die mid-stream, or go on publishing after they were given up on.

The stand-ins run a toy greedy "model" (each token a function of the whole context),
so a continuation is right exactly when the client's tokens equal an uninterrupted
run's."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
import pytest

from services.gateway.pipeline import Pipeline, Rejected, Report, UpstreamError
from services.gateway.retry import (
    Attempt,
    DecodeOrder,
    NotContinuable,
    RetryMetrics,
    attempt_id,
    continuation,
)
from shared import bus
from shared.block_hash import hex_hashes
from shared.config import ID_PATTERN, ClusterConfig
from shared.identity import ANY_UPDATES
from shared.liveness import Registry
from shared.messages import (
    CANCEL,
    NO_TOKEN,
    SCHEDULE,
    Cancel,
    DecodeAccept,
    DecodeRequest,
    Heartbeat,
    ModeRecord,
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
from tests.gateway.test_pipeline import nats_url  # noqa: F401  (the module's nats-server)

BS = 128
SALT = b"tiny"
PROMPT = list(range(300))  # two full blocks and a partial one


def model(context: list[int]) -> int:
    """The stand-ins' greedy next token: depends on every token before it, and its position."""
    return (31 * sum(context) + 17 * len(context)) % 1000 + 1000


def greedy(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(model(prompt + out))
    return out


# --- the pure parts ------------------------------------------------------------
def order(max_tokens: int = 10, min_tokens: int = 0, **sampling) -> DecodeOrder:
    s = Sampling(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.0, **sampling)
    return DecodeOrder(PROMPT, 7, s, hex_hashes(PROMPT, BS, SALT), kv_node="node-1", kv_blocks=2)


def test_a_continuation_decodes_the_prompt_plus_what_was_streamed_from_the_last_token():
    base = order(max_tokens=10, min_tokens=6)
    streamed = [7, 11, 12, 13]  # prefill's first token, then three from the decode that died
    c = continuation(base, streamed, BS, SALT)
    assert c.prompt == PROMPT + [7, 11, 12] and c.first_token_id == 13
    # max_tokens counts the first token (as DecodeRequest's does): 10 - 3 = 7, of which 13 is one: 6 more to come.
    assert (c.sampling.max_tokens, c.sampling.min_tokens, c.continued) == (7, 3, 3)
    assert c.sampling.temperature == 0.0 and base.sampling.max_tokens == 10  # the base is left as it was
    # The extended prompt's hashes: its leading blocks are the prompt's, which prefill sent to kv_node.
    assert c.block_hashes == hex_hashes(c.prompt, BS, SALT) and c.block_hashes[:2] == base.block_hashes
    assert (c.kv_blocks_on("node-1"), c.kv_blocks_on("node-2")) == (2, 0)
    # Continued twice: both times from the request's own prompt and everything streamed.
    again = continuation(base, streamed + [14, 15], BS, SALT)
    assert again.prompt == PROMPT + [7, 11, 12, 13, 14] and again.sampling.max_tokens == 5 and again.continued == 5


def test_nothing_streamed_past_the_first_token_decodes_as_first_asked():
    base = order()
    assert continuation(base, [], BS, SALT) is base  # refused before anything went out
    assert continuation(base, [7], BS, SALT) is base  # died before its first token


def test_a_stream_with_nothing_left_to_generate_ends():
    assert continuation(order(max_tokens=4), [7, 1, 2, 3], BS, SALT) is None


def test_history_dependent_sampling_starts_again_only_before_its_first_token():
    base = order(presence_penalty=0.5)
    assert continuation(base, [], BS, SALT) is base
    with pytest.raises(NotContinuable):
        continuation(base, [11], BS, SALT)


def test_each_attempt_has_a_subject_safe_id_of_its_own():
    rid = "0123456789abcdef0123456789abcdef"  # the gateway's: uuid4().hex
    ids = [attempt_id(rid, n) for n in (1, 2, 3)]
    assert ids == [rid, f"{rid}-a2", f"{rid}-a3"]
    assert all(ID_PATTERN.match(i) for i in ids)


def test_the_conductor_hears_completed_only_for_an_attempt_that_decoded_the_whole_output():
    a = Attempt("r", Placement(conductor="c0", prefill_id="p0", decode_id="d0", decode_node="n"))
    assert a.closing(whole=True) == RequestUpdate(request_id="r", kind="finished", completed=False)
    a.finished = True
    assert a.closing(whole=True).completed and not a.closing(whole=False).completed


# --- a fleet of stand-ins -------------------------------------------------------
@dataclass
class Fleet:
    """A Conductor that honours `avoid` and `stage`, prefill and decode instances
    with behaviours, and their heartbeats in the pipeline's registry.

    prefill behaviours: "ok", "silent" (takes the request, never answers).
    decode behaviours: "ok", "overloaded", ("dies", k) (streams k chunks, then stops
    beating), ("zombie", k) (the same, then publishes junk on its stream later)."""

    nc: object
    pipeline: Pipeline
    prefills: dict[str, object]
    decodes: dict[str, object]
    nodes: dict[str, str] = field(default_factory=dict)  # decode → node (default node-1)
    beating: set[str] = field(default_factory=set)
    schedules: list[ScheduleRequest] = field(default_factory=list)
    asked: list[tuple[str, object]] = field(default_factory=list)  # (instance, request)
    published: list[object] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self) -> None:
        self.beating |= set(self.prefills) | set(self.decodes)
        await bus.subscribe(self.nc, SCHEDULE, ScheduleRequest, self.on_schedule)
        for iid in self.prefills:
            await bus.subscribe(self.nc, prefill_subject(iid), PrefillRequest, self.prefill_handler(iid))
        for iid in self.decodes:
            await bus.subscribe(self.nc, decode_subject(iid), DecodeRequest, self.decode_handler(iid))
        await bus.subscribe(self.nc, ANY_UPDATES, UpdateBatch, self.on_updates)
        await bus.subscribe(self.nc, CANCEL, Cancel, self.on_published)
        self.spawn(self.beat())

    async def beat(self) -> None:
        while True:
            for iid in list(self.beating):
                role = "prefill" if iid in self.prefills else "decode"
                hb = Heartbeat(instance_id=iid, role=role, node="node-1", pid=1, seq=1, sent_at=0.0)
                self.pipeline.registry.observe(hb, time.monotonic())
            await asyncio.sleep(0.05)

    async def on_schedule(self, ask: ScheduleRequest, msg) -> None:
        self.schedules.append(ask)
        prefill = next((i for i in self.prefills if i not in ask.avoid), None)
        decode = next((i for i in self.decodes if i not in ask.avoid), None)
        local = not self.prefills and ask.stage == "full"  # no prefill instances: colocated
        if decode is None or (prefill is None and ask.stage == "full" and not local):
            reply = ScheduleReply(request_id=ask.request_id, accepted=False, rejection="unavailable", reason="none left")
        else:
            prefilled = ask.stage == "full" and not local
            placement = Placement(conductor="c0", prefill_id=prefill if prefilled else "", decode_id=decode,
                                  decode_node=self.nodes.get(decode, "node-1"), kv_blocks=2 if prefilled else 0,
                                  local_prefill=local)
            mode = ModeRecord(mode="colocated", rule="colocated", reason="least_delay") if local else None
            reply = ScheduleReply(request_id=ask.request_id, accepted=True, placement=placement, predicted_ttft_ms=10.0,
                                  mode=mode)
        await msg.respond(encode(reply))

    def prefill_handler(self, iid: str):
        async def on_prefill(ask: PrefillRequest, msg) -> None:
            self.asked.append((iid, ask))
            if self.prefills[iid] == "silent":
                return
            result = PrefillResult(request_id=ask.request_id, ok=True, first_token_id=model(ask.prompt_token_ids),
                                   kv_blocks=2)
            await msg.respond(encode(result))
        return on_prefill

    def decode_handler(self, iid: str):
        async def on_decode(ask: DecodeRequest, msg) -> None:
            self.asked.append((iid, ask))
            behaviour = self.decodes[iid]
            overloaded = behaviour == "overloaded"
            await msg.respond(encode(DecodeAccept(request_id=ask.request_id, ok=not overloaded, overloaded=overloaded,
                                                  error="busy" if overloaded else "")))
            if not overloaded:
                self.spawn(self.stream(iid, ask, behaviour))
        return on_decode

    async def stream(self, iid: str, ask: DecodeRequest, behaviour: object) -> None:
        """Decode as the real one does: prompt + first token, max_tokens - 1 more (or,
        a local prefill, the prompt alone and max_tokens)."""
        prefilled = ask.first_token_id != NO_TOKEN
        context = [*ask.prompt_token_ids, ask.first_token_id][: len(ask.prompt_token_ids) + prefilled]
        n = ask.sampling.max_tokens - prefilled
        dies_after = behaviour[1] if isinstance(behaviour, tuple) else n + 1
        for seq, token in enumerate(greedy(context, n)):
            if seq == dies_after:
                self.beating.discard(iid)  # dead: its heartbeats stop
                if behaviour[0] == "zombie":  # ... but a chunk of it still comes, late
                    await asyncio.sleep(1.0)
                    late = TokenChunk(request_id=ask.request_id, seq=seq, token_ids=[666])
                    await bus.publish(self.nc, ask.stream_subject, TokenBatch(chunks=[late]))
                return
            chunk = TokenChunk(request_id=ask.request_id, seq=seq, token_ids=[token],
                               finish_reason="length" if seq == n - 1 else None)
            await bus.publish(self.nc, ask.stream_subject, TokenBatch(chunks=[chunk]))
            await asyncio.sleep(0.01)

    async def on_published(self, message, _msg) -> None:
        self.published.append(message)

    async def on_updates(self, batch: UpdateBatch, _msg) -> None:
        # An update's token count (its tenant's quota settles on it) is checked in test_pipeline.py.
        self.published.extend(msgspec.structs.replace(u, tokens=-1) for u in batch.updates)

    def asked_of(self, iid: str) -> list[object]:
        return [a for i, a in self.asked if i == iid]


@asynccontextmanager
async def fleet(nats_url, prefills, decodes, **config):  # noqa: F811
    nc = await bus.connect(nats_url, name="test")
    cfg = ClusterConfig(model="/m/tiny", model_name="tiny", block_size=BS, heartbeat_interval_s=0.1,
                        liveness_timeout_s=0.5, **config)
    pipeline = Pipeline(nc, cfg, Registry(timeout_s=cfg.liveness_timeout_s))
    pipeline.started -= 10  # long past the start-up grace
    f = Fleet(nc, pipeline, prefills, decodes)
    await f.start()
    try:
        yield f
    finally:
        for task in list(f.tasks):
            task.cancel()
        await asyncio.gather(*f.tasks, return_exceptions=True)
        await nc.close()


async def run(f: Fleet, rid: str, max_tokens: int = 12, report: Report | None = None, **sampling) -> list[int]:
    s = Sampling(max_tokens=max_tokens, temperature=0.0, **sampling)
    chunks = [c async for c in f.pipeline.run(rid, PROMPT, s, time.time() + 20, report=report)]
    assert chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids]


def retries(f: Fleet, stage: str) -> float:
    return f.pipeline.retries.retries.labels(stage)._value.get()


async def test_a_prefill_that_never_answers_is_placed_on_another_prefill(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "silent", "p1": "ok"}, {"d0": "ok"}, prefill_timeout_s=0.3) as f:
        started = time.monotonic()
        assert await run(f, "r1") == greedy(PROMPT, 12)
        assert time.monotonic() - started < 3
        first, second = f.schedules
        assert (first.request_id, first.avoid, second.request_id, second.avoid) == ("r1", [], "r1-a2", ["p0"])
        assert [a.request_id for a in f.asked_of("p1")] == ["r1-a2"]
        assert retries(f, "prefill") == 1
        await eventually(lambda: Cancel(request_id="r1", reason="abandoned by gateway") in f.published)
        # The Conductor closes its books on both: the stalled attempt, and the one that completed.
        await eventually(lambda: RequestUpdate(request_id="r1", kind="finished") in f.published)
        await eventually(lambda: RequestUpdate(request_id="r1-a2", kind="finished", completed=True) in f.published)


async def test_a_prefill_instance_that_stops_beating_is_left_within_heartbeats(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "silent", "p1": "ok"}, {"d0": "ok"}) as f:
        f.beating.discard("p0")
        await asyncio.sleep(0.6)  # past liveness_timeout_s
        started = time.monotonic()
        assert await run(f, "r2") == greedy(PROMPT, 12)
        assert time.monotonic() - started < 2  # far below the default 60 s prefill timeout
        assert f.schedules[1].avoid == ["p0"]


async def test_a_refusing_decode_is_followed_by_another_decode_choice(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "ok"}, {"d0": "overloaded", "d1": "ok"}) as f:
        report = Report()
        assert await run(f, "r3", report=report) == greedy(PROMPT, 12)
        first, second = f.schedules
        assert (first.stage, first.avoid) == ("full", [])
        assert (second.stage, second.avoid, second.prompt_len, second.max_tokens) == ("decode", ["d0"], len(PROMPT), 12)
        assert len(f.asked_of("p0")) == 1  # prefill is not run again
        [refused], [taken] = f.asked_of("d0"), f.asked_of("d1")
        assert (taken.request_id, taken.stream_subject) == ("r3-a2", f.pipeline.inbox.subject)
        assert (taken.prompt_token_ids, taken.first_token_id) == (refused.prompt_token_ids, refused.first_token_id)
        assert taken.kv_blocks == 2  # same node: the blocks prefill sent are there
        assert (report.placement.prefill_id, report.placement.decode_id, report.attempts) == ("p0", "d1", 2)
        assert retries(f, "decode") == 1


async def test_decodes_that_all_refuse_end_in_a_429_after_bounded_attempts(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "ok"}, {"d0": "overloaded", "d1": "overloaded", "d2": "ok"},
                     max_attempts=2) as f:
        with pytest.raises(Rejected) as refused:
            await run(f, "r4")
        assert refused.value.reply.rejection == "overloaded"
        assert [s.request_id for s in f.schedules] == ["r4", "r4-a2"] and not f.asked_of("d2")
        await eventually(lambda: RequestUpdate(request_id="r4-a2", kind="decode_refused", instance_id="d1") in f.published)
        assert f.pipeline.retries.given_up.labels("decode", "attempts")._value.get() == 1


async def test_a_decode_that_dies_mid_stream_is_continued_on_another_with_every_token_once(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "ok"}, {"d0": ("zombie", 4), "d1": "ok"}) as f:
        f.nodes["d1"] = "node-2"
        report = Report()
        tokens = await run(f, "r5", max_tokens=12, report=report, min_tokens=10)
        assert tokens == greedy(PROMPT, 12)  # no token missing or repeated; the zombie's late 666 never shows
        [_], [cont] = f.asked_of("d0"), f.asked_of("d1")
        streamed = tokens[:5]  # prefill's token and d0's four
        assert cont.prompt_token_ids == PROMPT + streamed[:-1] and cont.first_token_id == streamed[-1]
        assert (cont.sampling.max_tokens, cont.sampling.min_tokens) == (12 - 4, 10 - 4)
        assert cont.block_hashes == hex_hashes(cont.prompt_token_ids, BS, f.pipeline.config.model_salt)
        assert cont.kv_blocks == 0  # another node: its pool lacks the prompt's blocks, decode computes them
        assert f.schedules[1].stage == "decode" and f.schedules[1].avoid == ["d0"]
        assert (report.migrations, report.attempts, report.placement.decode_id) == (1, 2, "d1")
        assert retries(f, "migration") == 1
        await asyncio.sleep(1.2)  # the zombie's late chunk went to its own attempt's subject, unheard


async def test_a_history_dependent_stream_is_not_continued_but_ends_cleanly(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "ok"}, {"d0": ("dies", 3), "d1": "ok"}) as f:
        with pytest.raises(UpstreamError) as failed:
            await run(f, "r6", presence_penalty=0.5)
        assert failed.value.status == 503 and "not continued" in str(failed.value)
        assert not f.asked_of("d1")
        assert f.pipeline.retries.given_up.labels("migration", "history_dependent")._value.get() == 1


async def test_a_history_dependent_request_whose_decode_dies_before_any_token_starts_again(nats_url):  # noqa: F811
    async with fleet(nats_url, {"p0": "ok"}, {"d0": ("dies", 0), "d1": "ok"}) as f:
        tokens = await run(f, "r7", presence_penalty=0.5)
        # Decode runs the whole output (the stand-in: prompt + prefill's token, as the real one's first token is its own).
        assert tokens == greedy(PROMPT + [model(PROMPT)], 11)
        assert f.asked_of("d1")[0].prompt_token_ids == PROMPT


def test_the_retry_counters_reach_a_prometheus_page():
    from prometheus_client import CollectorRegistry, generate_latest

    registry, metrics = CollectorRegistry(), RetryMetrics()
    metrics.register(registry)
    metrics.retries.labels("migration").inc()
    page = generate_latest(registry).decode()
    assert 'yuebing_gateway_retries_total{stage="migration"} 1.0' in page
    assert 'yuebing_gateway_retries_total{stage="prefill"} 0.0' in page


async def eventually(check, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# --- local prefills (serving modes colocated and conditional) ------------------
async def test_a_local_prefill_is_decoded_from_the_prompt_alone_and_its_first_token_closes_prefill(nats_url):  # noqa: F811
    async with fleet(nats_url, {}, {"d0": "ok"}) as f:
        report = Report()
        assert await run(f, "r7", report=report) == greedy(PROMPT, 12)
        [asked] = f.asked_of("d0")
        assert (asked.prompt_token_ids, asked.first_token_id, asked.kv_blocks) == (PROMPT, NO_TOKEN, 0)
        assert asked.sampling.max_tokens == 12  # every token is decode's
        assert report.mode.mode == "colocated" and report.placement.local_prefill
        assert f.pipeline.modes.labels("colocated", "colocated", "least_delay")._value.get() == 1
        # The Conductor's books hear its prefill is done, from the gateway, at its first token.
        await eventually(lambda: RequestUpdate(request_id="r7", kind="prefill_done", instance_id="d0") in f.published)


async def test_a_local_prefill_whose_decode_dies_mid_stream_is_continued_from_its_tokens(nats_url):  # noqa: F811
    async with fleet(nats_url, {}, {"d0": ("dies", 4), "d1": "ok"}) as f:
        tokens = await run(f, "r8", max_tokens=12)
        assert tokens == greedy(PROMPT, 12)
        [cont] = f.asked_of("d1")
        streamed = tokens[:4]  # all four from d0: its first token is the local prefill's
        assert cont.prompt_token_ids == PROMPT + streamed[:-1] and cont.first_token_id == streamed[-1]
        assert cont.sampling.max_tokens == 12 - 3


async def test_a_refused_local_prefill_wasted_no_prefill(nats_url):  # noqa: F811
    async with fleet(nats_url, {}, {"d0": "overloaded", "d1": "overloaded"}, max_attempts=2) as f:
        with pytest.raises(Rejected):
            await run(f, "r9")
        await eventually(lambda: RequestUpdate(request_id="r9-a2", kind="finished") in f.published)
        assert not [u for u in f.published if isinstance(u, RequestUpdate) and u.kind == "decode_refused"]
