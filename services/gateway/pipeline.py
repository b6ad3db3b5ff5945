"""One request through the disaggregated cluster: ask the Conductor where it runs,
prefill the prompt there, decode the rest on the decode instance it chose, and
stream the tokens back. The gateway executes the Conductor's placement; it never
places anything itself.

Every wait is bounded by the request's deadline and by the liveness of the instance
being waited on, so a dead instance fails the attempt within a few heartbeats; the
request is then placed again elsewhere, within max_attempts and its deadline
(services/gateway/retry.py: a new prefill, another decode, or a continuation of the
stream on another decode).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import structlog
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, Counter

from services.gateway.retry import (
    Attempt,
    DecodeOrder,
    NotContinuable,
    RetryMetrics,
    Stage,
    Tries,
    continuation,
    with_decode,
)
from services.gateway.stream import Inbox, Sink, StreamEnded, TokenStream
from shared import bus, tracing
from shared.block_hash import hex_hashes, request_salt
from shared.config import ClusterConfig
from shared.liveness import Registry, woke_late
from shared.messages import (
    CANCEL,
    NO_TOKEN,
    SCHEDULE,
    Cancel,
    DecodeAccept,
    DecodeRequest,
    Message,
    MessageError,
    ModeRecord,
    Placement,
    PrefillRequest,
    PrefillResult,
    RateLimit,
    RequestUpdate,
    Sampling,
    ScheduleReply,
    ScheduleRequest,
    TokenChunk,
    TokenLogprobs,
    decode_subject,
    prefill_subject,
)
from shared.outbox import Outbox
from shared.tenants import DEFAULT_TENANT

log = structlog.get_logger(__name__)
T = TypeVar("T")
NO_CONDUCTOR_POLL_S = 0.1  # while no Conductor answers at all, how often to ask again
# A prefill is taken for stalled after max(prefill_timeout_s, this x its predicted TTFT).
PREDICTED_TTFT_SLACK = 4.0


@dataclass(frozen=True)
class Slo:
    """A request's own latency targets, ms; 0 takes the cluster default."""

    ttft_ms: float = 0.0
    tbt_ms: float = 0.0


@dataclass(frozen=True)
class Owner:
    """Whose request it is: its tenant, and the salt its blocks are hashed under
    (its cache group's: services/gateway/access.py; "": the cluster's one cache)."""

    tenant: str = DEFAULT_TENANT
    cache_salt: str = ""


@dataclass
class Report:
    """Where and how a request ran, filled in as it runs: the response's `yuebing`
    field and the gateway's metrics read it."""

    placement: Placement | None = None
    cached_tokens: int = 0  # prompt tokens prefill did not compute
    kv_blocks: int = -1  # prompt blocks prefill's pool took and sent toward decode (-1: not known)
    kv_loaded_tokens: int = 0  # prompt tokens whose KV decode loaded rather than computed
    attempts: int = 0  # placements it went through (services/gateway/retry.py); 1: no retry
    migrations: int = 0  # decodes that died mid-stream and were continued on another
    mode: ModeRecord | None = None  # where its prefill ran and why, as the Conductor decided
    route: str = ""  # a CPP group or a single prefill instance, and why (ScheduleReply.route)
    prefills: int = 0  # times its prompt was prefilled (once, whatever n, unless an instance failed it)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # where prefill computed them, when asked
    limits: list[RateLimit] = field(default_factory=list)  # its tenant's quotas after it: the x-ratelimit-* headers
    streamed_tokens: int = 0  # output tokens handed on so far, every output's


class Rejected(Exception):
    def __init__(self, reply: ScheduleReply) -> None:
        super().__init__(reply.reason)
        self.reply = reply


class DecodeRefused(Exception):
    """The decode instance turned the request away to keep its TBT SLO."""


class UpstreamError(Exception):
    """The cluster could not serve the request; `status` is the HTTP status to show."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Lost(UpstreamError):
    """A NATS connection between the gateway and an instance was remade while the
    gateway waited on it (a server of the cluster died): what went either way may be
    lost. The request is placed again; the instance is not at fault, so not avoided."""

    def __init__(self, instance_id: str, what: str = "a NATS connection on the way was remade while waiting on it"
                 ) -> None:
        super().__init__(503, f"{instance_id}: {what}")


class InvalidRequest(UpstreamError):
    """The engine refused the request itself: a 400, never retried elsewhere."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def kv_expected(planned: int, sent: int) -> int:
    """The blocks decode waits for: the planned ones, but no more than prefill says are
    on their way (`sent` < 0: it did not say). A block prefill's pool had no room for
    never comes, and waiting kv_wait_s for it would only delay the first decode step."""
    return planned if sent < 0 else min(planned, sent)


class ChunkCheck:
    """A decode's chunks checked as they come: in order, each of the request's `n`
    outputs, no error; `done` once every output has ended."""

    def __init__(self, decode_id: str, n: int) -> None:
        self.decode_id, self.n = decode_id, n
        self.seq = 0
        self.ended: set[int] = set()
        self.done = False

    def take(self, chunk: TokenChunk) -> None:
        if (fault := self._fault(chunk)) is not None:
            raise fault
        self.seq += 1
        if chunk.finish_reason is not None:
            self.ended.add(chunk.index)
            self.done = len(self.ended) == self.n

    def plain(self, chunk: TokenChunk) -> bool:
        """An ordinary token of the stream: one `take` passes without ending anything,
        after the first, carrying nothing but tokens."""
        return chunk.seq > 0 and chunk.finish_reason is None and not chunk.kv_loaded_tokens \
            and self._fault(chunk) is None

    def _fault(self, chunk: TokenChunk) -> UpstreamError | None:
        """What is wrong with the chunk as the stream's next, if anything."""
        if chunk.seq != self.seq:  # one went missing on the way (a NATS server died): the stream goes on elsewhere
            return Lost(self.decode_id, f"token stream out of order: got chunk {chunk.seq}, expected {self.seq}")
        if chunk.error:
            return UpstreamError(502, f"decode on {self.decode_id} failed: {chunk.error}")
        if not 0 <= chunk.index < self.n:
            return UpstreamError(502, f"decode on {self.decode_id} sent output {chunk.index} of a request of {self.n}")
        return None


@dataclass(frozen=True)
class Job:
    """One request as the pipeline carries it from step to step."""

    request_id: str
    prompt: list[int]
    block_hashes: list[str]
    sampling: Sampling
    deadline: float
    slo: Slo
    owner: Owner = Owner()
    sink: Sink | None = None  # takes a decode's ordinary chunks as they arrive, past this generator (TokenStream)


@dataclass
class Taking:
    """One decode attempt's chunks as the pipeline takes them: checked, and its books
    kept (the tokens the client has, the report, the attempt's end). The same steps
    for a chunk yielded through the pipeline and for one a sink took on arrival."""

    outbox: Outbox  # the pipeline's: its request updates
    attempt: Attempt
    order: DecodeOrder
    checked: ChunkCheck
    streamed: list[int]  # the request's tokens the client has, in order
    report: Report

    def take(self, chunk: TokenChunk) -> TokenChunk:
        self.checked.take(chunk)
        if self.order.continued:  # it loaded (or computed) KV for a prompt that holds output: not prefill's
            chunk = msgspec.structs.replace(chunk, kv_loaded_tokens=0)
        if self.order.first_token_id == NO_TOKEN and chunk.seq == 0:
            self._prefilled_locally(chunk)
        self.report.kv_loaded_tokens = self.report.kv_loaded_tokens or chunk.kv_loaded_tokens
        self.streamed.extend(chunk.token_ids)
        self.attempt.finished = self.checked.done
        return chunk

    def _prefilled_locally(self, chunk: TokenChunk) -> None:
        """A local prefill's first token is out: the Conductor's books move it from
        prefilling to decoding, as a prefill instance's prefill_done does."""
        self.report.cached_tokens = chunk.kv_loaded_tokens
        self.report.prompt_logprobs = chunk.prompt_logprobs
        self.report.prefills += 1
        update = RequestUpdate(request_id=self.attempt.id, kind="prefill_done",
                               instance_id=self.attempt.placement.decode_id)
        self.outbox.send(self.attempt.updates, update)

    def sunk(self, sink: Sink) -> Sink:
        """`sink`, given the attempt's ordinary chunks only, each taken here once it took it."""

        def take(chunk: TokenChunk) -> bool:
            if not self.checked.plain(chunk) or not sink(chunk):
                return False
            self.take(chunk)
            self.report.streamed_tokens += len(chunk.token_ids)
            return True

        return take


class Pipeline:
    def __init__(self, nc: Client, config: ClusterConfig, registry: Registry) -> None:
        self.nc = nc
        self.inbox = Inbox()  # where decode instances send this gateway's tokens
        self.outbox = Outbox(nc)  # its request updates, a turn's in one message
        self.config = config
        self.registry = registry
        self.started = time.monotonic()
        self.retries = RetryMetrics()
        # On the gateway's page (register), like the retry counters.
        self.modes = Counter("yuebing_gateway_serving_mode", "Placements by the Conductor's serving-mode decision: "
                             "mode (disaggregated, local: prefilled on its decode, colocated), rule and reason",
                             ["mode", "rule", "reason"], registry=None)

    def register(self, registry: CollectorRegistry) -> None:
        """The pipeline's counters onto the gateway's page."""
        self.retries.register(registry)
        registry.register(self.modes)
        registry.register(self.inbox.dropped)
        registry.register(self.inbox.batches)

    async def run(
        self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float, slo: Slo = Slo(),
        report: Report | None = None, owner: Owner = Owner(), sink: Sink | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """The request's tokens, the first from prefill, the rest from decode; placed
        again (within max_attempts and the deadline) when an instance fails it.
        `sink`: where a decode's ordinary tokens go instead, when it takes them (they
        are then not yielded here; see services/gateway/stream.py)."""
        report = report if report is not None else Report()
        # The one place the prompt is hashed: the Conductor and prefill take these.
        with tracing.span("gateway.hash", request_id, prompt_tokens=len(prompt)):
            hashes = hex_hashes(prompt, self.config.block_size, request_salt(self.config.model_salt, owner.cache_salt))
        job = Job(request_id, prompt, hashes, sampling, deadline, slo, owner, sink)
        tries = Tries(request_id, self.config.max_attempts, self.retries)
        whole = True  # no continuation: the last attempt decoded the whole output
        try:
            async for chunk in self._serve(job, tries, report):
                whole = whole and not report.migrations  # a continuation's first chunk always comes this way
                report.streamed_tokens += len(chunk.token_ids)
                yield chunk
        except DecodeRefused as e:
            raise Rejected(ScheduleReply(request_id=request_id, accepted=False, rejection="overloaded", reason=str(e),
                                         retry_after_s=1.0)) from e
        finally:
            report.attempts = tries.count
            if tries.current is not None:
                await self._close(tries.current, whole, len(prompt) + report.streamed_tokens)

    async def _serve(self, job: Job, tries: Tries, report: Report) -> AsyncIterator[TokenChunk]:
        result = await self._prefilled(job, tries, report)
        if result is None:  # its decode instance prefills it (Placement.local_prefill)
            base = DecodeOrder(job.prompt, NO_TOKEN, job.sampling, job.block_hashes, "", 0)
            async for chunk in self._decoded(job, tries, base, None, report):
                yield chunk
            return
        report.cached_tokens, report.kv_blocks = result.num_cached_tokens, result.kv_blocks
        report.prompt_logprobs = result.prompt_logprobs
        first = TokenChunk(request_id=job.request_id, seq=0, token_ids=[result.first_token_id],
                           finish_reason=result.finish_reason,
                           logprobs=[result.first_logprobs] if result.first_logprobs is not None else [])
        attempt = self._current(tries)
        if result.finish_reason is not None and job.sampling.n == 1:  # with n > 1, decode samples every output
            attempt.finished = True
            yield first
            return
        placement = attempt.placement
        kv_blocks = kv_expected(placement.kv_blocks, result.kv_blocks)
        if kv_blocks < placement.kv_blocks:
            log.info("kv blocks not coming: decode computes them", planned=placement.kv_blocks, kv_blocks=kv_blocks)
        base = DecodeOrder(job.prompt, result.first_token_id, job.sampling, job.block_hashes, placement.decode_node,
                           kv_blocks)
        async for chunk in self._decoded(job, tries, base, first, report):
            yield chunk

    async def _prefilled(self, job: Job, tries: Tries, report: Report) -> PrefillResult | None:
        """The prompt's first token, from the placed prefill instance or, when that one
        dies, stalls or fails first, from another; None when the placement has its
        decode instance prefill it."""
        attempt = await self._place(job, tries, None)
        while True:
            report.placement, report.mode, report.route = attempt.placement, attempt.mode, attempt.route
            report.limits = report.limits or attempt.limits  # the first placement's: the one counted
            if attempt.placement.local_prefill:
                return None
            try:
                result = await self._prefill(job, attempt)
                report.prefills += 1
                return result
            except InvalidRequest:
                raise
            except UpstreamError as e:
                attempt = await self._again(job, tries, e, "prefill", attempt.placement.prefill_id, None)

    async def _decoded(
        self, job: Job, tries: Tries, base: DecodeOrder, first: TokenChunk | None, report: Report
    ) -> AsyncIterator[TokenChunk]:
        """Every token after prefill's (`first`; None: the decode makes every token):
        from the placed decode instance, or another one after a refusal, or a
        continuation on another one after it died."""
        streamed: list[int] = []  # what the client has, in order
        order: DecodeOrder | None = base
        while order is not None:
            attempt = self._current(tries)
            try:
                async for chunk in self._decode_once(job, attempt, order, first, streamed, report):
                    yield chunk
                return
            except (DecodeRefused, UpstreamError) as e:
                stage: Stage = "migration" if streamed else "decode"  # the client has tokens, or not yet
                order = self._continuation(job, tries, base, streamed, e, stage)
                if order is None:
                    break
                await self._again(job, tries, e, stage, attempt.placement.decode_id, order)
                report.placement = with_decode(report.placement, self._current(tries).placement)
                report.mode = self._current(tries).mode or report.mode  # a fallback onto a prefill instance says so
                report.migrations += stage == "migration"
        # Every token the request may have is out, but its end never came: it ends here.
        self._current(tries).finished = True
        yield TokenChunk(request_id=job.request_id, seq=0, token_ids=[], finish_reason="length")

    def _continuation(self, job: Job, tries: Tries, base: DecodeOrder, streamed: list[int], error: Exception,
                      stage: Stage) -> DecodeOrder | None:
        """What the next decode is asked after `error` (see retry.continuation); a
        stream that cannot be continued exactly ends with a clean 503."""
        try:
            salt = request_salt(self.config.model_salt, job.owner.cache_salt)
            return continuation(base, streamed, self.config.block_size, salt)
        except NotContinuable as e:
            if bus.remaining(job.deadline) <= 0:  # it could not have gone on anyway: the deadline is the news
                raise error from None
            tries.give_up(stage, "history_dependent", error)
            raise UpstreamError(503, f"{error}; not continued on another decode instance: {e}") from error

    async def _decode_once(
        self, job: Job, attempt: Attempt, order: DecodeOrder, first: TokenChunk | None, streamed: list[int],
        report: Report,
    ) -> AsyncIterator[TokenChunk]:
        """One decode instance's share of the output, each token added to `streamed`."""
        # Decode must accept before the first token goes out, so that a refusal
        # can still be a clean 429 rather than an error in the middle of a stream.
        stream = await self._start_decode(job, attempt, order)
        try:
            # Else decode makes the first token itself: a local prefill, or again, with its history.
            if first is not None and not streamed and not job.sampling.history_dependent:
                streamed.extend(first.token_ids)
                yield first
            taking = Taking(self.outbox, attempt, order, ChunkCheck(attempt.placement.decode_id, job.sampling.n), streamed,
                            report)
            if job.sink is not None:
                stream.sink = taking.sunk(job.sink)
            while not taking.checked.done:  # a loop, not a generator: every token the sink leaves passes here
                yield taking.take(await self._next_chunk(stream))
        finally:
            await stream.close()

    @staticmethod
    def _current(tries: Tries) -> Attempt:
        assert tries.current is not None, "an attempt is placed before anything runs"
        return tries.current

    async def _place(self, job: Job, tries: Tries, order: DecodeOrder | None) -> Attempt:
        """A new attempt, placed by the Conductor: the whole request, or (`order`) a decode alone."""
        attempt_id = tries.next_id()
        reply = await self._schedule(job, attempt_id, tries.avoid, order)
        assert reply.placement is not None
        # Current before anything else awaits: whatever ends the request from here closes it.
        tries.current = Attempt(attempt_id, reply.placement, reply.predicted_ttft_ms, mode=reply.mode,
                                route=reply.route, limits=reply.limits)
        if reply.mode is not None:
            self.modes.labels(reply.mode.mode, reply.mode.rule, reply.mode.reason).inc()
        return tries.current

    async def _again(
        self, job: Job, tries: Tries, error: Exception, stage: Stage, failed: str, order: DecodeOrder | None
    ) -> Attempt:
        """Place the request again after `error`, avoiding the instance that failed
        it, once the failed attempt is closed; raises `error` when out of attempts or
        time, or when the Conductor has nowhere else to put it."""
        old = self._current(tries)
        # A decode refusal that ends the request wasted its prefill: the Conductor counts it.
        prefilled = order is None or order.first_token_id != NO_TOKEN  # not a local prefill: it had one
        wasted = RequestUpdate(request_id=old.id, kind="decode_refused", instance_id=failed) \
            if isinstance(error, DecodeRefused) and prefilled else None
        if not tries.may_retry(stage, error, job.deadline):
            old.update = wasted
            raise error
        tries.retrying(stage, error, "" if isinstance(error, Lost) else failed)
        # Closed first, so that the Conductor's books no longer count it when it places the next.
        tries.current = None
        await self._close(old, whole=False)
        await self.outbox.flush()
        try:
            return await self._place(job, tries, order)
        except (Rejected, UpstreamError) as e:
            tries.give_up(stage, "no_instance", e)
            if wasted is not None:
                self.outbox.send(old.updates, wasted)
            raise error from e

    async def _close(self, attempt: Attempt, whole: bool, tokens: int = -1) -> None:
        """An attempt ends: free its instances' slots unless it ran to its end, and
        let the Conductor close its books."""
        if not attempt.finished:  # cancelled, failed or abandoned
            await self._publish(CANCEL, Cancel(request_id=attempt.id, reason="abandoned by gateway"))
        self.outbox.send(attempt.updates, attempt.closing(whole, tokens))

    async def _schedule(
        self, job: Job, attempt_id: str, avoid: list[str], order: DecodeOrder | None
    ) -> ScheduleReply:
        prompt, hashes, sampling = (job.prompt, job.block_hashes, job.sampling) if order is None else \
            (order.prompt, order.block_hashes, order.sampling)
        ask = ScheduleRequest(
            request_id=attempt_id,
            prompt_len=len(prompt),
            block_hashes=hashes,
            max_tokens=sampling.max_tokens,
            deadline=job.deadline,
            slo_ttft_ms=job.slo.ttft_ms,
            slo_tbt_ms=job.slo.tbt_ms,
            avoid=list(avoid),
            stage="full" if order is None else "decode",
            tenant=job.owner.tenant,
        )
        try:
            with tracing.span("gateway.schedule", attempt_id, stage=ask.stage):
                reply = await self._ask_twice(ask, job.deadline)
        except (TimeoutError, MessageError) as e:
            raise UpstreamError(503, f"conductor unavailable: {e}") from e
        if not reply.accepted or reply.placement is None:
            raise Rejected(reply)
        log.info("scheduled", attempt=attempt_id, prefill=reply.placement.prefill_id or None,
                 decode=reply.placement.decode_id, predicted_ttft_ms=round(reply.predicted_ttft_ms, 1),
                 predicted_tbt_ms=round(reply.predicted_tbt_ms, 2),
                 mode=f"{reply.mode.mode}:{reply.mode.reason}" if reply.mode else None)
        return reply

    async def _ask_twice(self, ask: ScheduleRequest, deadline: float) -> ScheduleReply:
        """The Conductor's answer; one that does not answer in time is asked once more
        (where several Conductors run, the queue group picks among those alive: one
        killed mid-decision loses no request). A Conductor that did book the first ask
        has its booking replaced by the second's, under the same request id."""
        try:
            return await self._ask_conductor(ask, min(self.config.schedule_timeout_s, bus.remaining(deadline)))
        except TimeoutError as e:
            if bus.remaining(deadline) <= self.config.schedule_timeout_s:
                raise
            log.warning("conductor did not answer: asking again", attempt=ask.request_id, error=str(e))
        return await self._ask_conductor(ask, self.config.schedule_timeout_s)

    async def _ask_conductor(self, ask: ScheduleRequest, timeout: float) -> ScheduleReply:
        """The Conductor's answer within `timeout`; while no Conductor is subscribed (one
        restarting after a crash takes a second or two), ask again until then."""
        end = time.monotonic() + timeout
        while True:
            try:
                return await bus.request(self.nc, SCHEDULE, ask, ScheduleReply, end - time.monotonic())
            except bus.NoResponders:
                if end - time.monotonic() < NO_CONDUCTOR_POLL_S:
                    raise
                await asyncio.sleep(NO_CONDUCTOR_POLL_S)

    def _prefill_timeout(self, attempt: Attempt, deadline: float) -> float:
        """How long to wait for a prefill's first token before placing it elsewhere: a
        stall is far beyond the predicted TTFT, a long queue is not."""
        stall = max(self.config.prefill_timeout_s, PREDICTED_TTFT_SLACK * attempt.predicted_ttft_ms / 1e3)
        return min(stall, bus.remaining(deadline))

    async def _prefill(self, job: Job, attempt: Attempt) -> PrefillResult:
        placement = attempt.placement
        ask = PrefillRequest(
            request_id=attempt.id,
            prompt_token_ids=job.prompt,
            block_hashes=job.block_hashes,
            sampling=job.sampling,
            deadline=job.deadline,
            placement=placement,
            tenant=job.owner.tenant,
            cache_salt=job.owner.cache_salt,
        )
        with tracing.span("gateway.prefill", attempt.id, instance=placement.prefill_id):
            asked = bus.request(self.nc, prefill_subject(placement.prefill_id), ask, PrefillResult,
                                timeout=self._prefill_timeout(attempt, job.deadline))
            result = await self._watch(placement.prefill_id, asked, job.deadline)
        if result.invalid:
            raise InvalidRequest(result.error)
        if not result.ok:
            raise UpstreamError(502, f"prefill on {placement.prefill_id} failed: {result.error}")
        return result

    async def _start_decode(self, job: Job, attempt: Attempt, order: DecodeOrder) -> TokenStream:
        """Hand the request to its decode instance; returns the stream its tokens
        will arrive on (the caller closes it)."""
        # Open before asking, so no chunk can come before we listen. Chunks are routed by
        # the attempt's own id: a dead attempt's late chunk never lands here.
        decode_id = attempt.placement.decode_id
        since = time.time()
        stream = TokenStream(decode_id, job.deadline, self.config.token_idle_timeout_s,
                             self.config.heartbeat_interval_s, lambda iid: self._check_instance(iid, since))
        await stream.open(self.inbox, self.nc, attempt.id)
        ask = DecodeRequest(
            request_id=attempt.id,
            prompt_token_ids=order.prompt,
            first_token_id=order.first_token_id,
            sampling=order.sampling,
            deadline=job.deadline,
            stream_subject=self.inbox.subject,
            stream_channel=self.inbox.channel.endpoint,
            stream_key=self.inbox.channel.key if self.inbox.channel.endpoint else b"",
            slo_tbt_ms=job.slo.tbt_ms or self.config.slo_tbt_ms,
            block_hashes=order.block_hashes,
            kv_blocks=order.kv_blocks_on(attempt.placement.decode_node),
            tenant=job.owner.tenant,
            cache_salt=job.owner.cache_salt,
        )
        timeout = min(self.config.schedule_timeout_s * 2, bus.remaining(job.deadline))
        try:
            with tracing.span("gateway.decode_start", attempt.id, instance=decode_id):
                accept = await bus.request(self.nc, decode_subject(decode_id), ask, DecodeAccept, timeout)
            if accept.overloaded:
                raise DecodeRefused(f"decode instance {decode_id}: {accept.error}")
            if not accept.ok:
                raise UpstreamError(503, f"decode instance {decode_id} refused: {accept.error}")
        except (TimeoutError, MessageError) as e:
            await stream.close()
            raise UpstreamError(503, f"decode instance {decode_id} unavailable: {e}") from e
        except BaseException:
            await stream.close()
            raise
        return stream

    @staticmethod
    async def _next_chunk(stream: TokenStream) -> TokenChunk:
        try:
            return await stream.next()
        except StreamEnded as e:
            raise UpstreamError(e.status, str(e)) from e

    async def _watch(self, instance_id: str, work: Awaitable[T], deadline: float) -> T:
        """Await `work`, giving up as soon as `instance_id` stops beating."""
        task = asyncio.ensure_future(work)
        interval = self.config.heartbeat_interval_s
        since = time.time()
        try:
            while True:
                waited_from = time.monotonic()
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    try:
                        return task.result()
                    except TimeoutError as e:
                        status = 504 if bus.remaining(deadline) <= 0 else 503
                        raise UpstreamError(status, f"{instance_id}: {e}") from e
                    except MessageError as e:
                        raise UpstreamError(502, f"bad reply from {instance_id}: {e}") from e
                if not woke_late(waited_from, interval, interval):  # else: heartbeats still unread
                    self._check_instance(instance_id, since)
        finally:
            task.cancel()

    def _check_instance(self, instance_id: str, since: float) -> None:
        """Raises when the instance stopped beating, or when its NATS client or this
        gateway's reconnected after `since` (unix time): a wait begun before may never
        be answered."""
        self._check_alive(instance_id)
        hb = self.registry.latest.get(instance_id)
        mine = self.nc.reconnected.at if isinstance(self.nc, bus.Link) else 0.0
        if max(mine, hb.reconnected_at if hb is not None else 0.0) > since:
            raise Lost(instance_id)

    def _check_alive(self, instance_id: str) -> None:
        now = time.monotonic()
        self.registry.heard(now)
        # An instance this gateway has not heard from yet is given the benefit of the
        # doubt until one liveness period has passed since the gateway started.
        if now - self.started > self.config.liveness_timeout_s and not self.registry.is_alive(instance_id, now):
            raise UpstreamError(503, f"instance {instance_id} stopped responding (missed heartbeats)")

    async def _publish(self, subject: str, message: Message) -> None:
        try:
            await bus.publish(self.nc, subject, message)
        except Exception as e:  # best effort: deadlines clean up what a lost message leaves
            log.warning("not sent", subject=subject, error=str(e))
