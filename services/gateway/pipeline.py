"""One request through the disaggregated cluster: ask the Conductor where it runs,
prefill the prompt there, decode the rest on the decode instance it chose, and
stream the tokens back. The gateway executes the Conductor's placement; it never
places anything itself.

Every wait is bounded by the request's deadline and by the liveness of the instance
being waited on, so a dead instance fails the request within a few heartbeats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from shared import bus
from shared.block_hash import hex_hashes
from shared.config import ClusterConfig
from shared.liveness import Registry
from shared.messages import (
    CANCEL,
    REQUEST_UPDATES,
    SCHEDULE,
    Cancel,
    DecodeAccept,
    DecodeRequest,
    Message,
    MessageError,
    Placement,
    PrefillRequest,
    PrefillResult,
    RequestUpdate,
    Sampling,
    ScheduleReply,
    ScheduleRequest,
    TokenChunk,
    decode,
    decode_subject,
    prefill_subject,
    stream_subject,
)

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Slo:
    """A request's own latency targets, ms; 0 takes the cluster default."""

    ttft_ms: float = 0.0
    tbt_ms: float = 0.0


@dataclass
class Report:
    """Where and how a request ran, filled in as it runs: the response's `yuebing`
    field and the gateway's metrics read it."""

    placement: Placement | None = None
    cached_tokens: int = 0  # prompt tokens prefill did not compute
    kv_blocks: int = -1  # prompt blocks prefill's pool took and sent toward decode (-1: not known)
    kv_loaded_tokens: int = 0  # prompt tokens whose KV decode loaded rather than computed


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


def kv_expected(planned: int, sent: int) -> int:
    """The blocks decode waits for: the planned ones, but no more than prefill says are
    on their way (`sent` < 0: it did not say). A block prefill's pool had no room for
    never comes, and waiting kv_wait_s for it would only delay the first decode step."""
    return planned if sent < 0 else min(planned, sent)


@dataclass(frozen=True)
class Job:
    """One request as the pipeline carries it from step to step."""

    request_id: str
    prompt: list[int]
    block_hashes: list[str]
    sampling: Sampling
    deadline: float
    slo: Slo


class Pipeline:
    def __init__(self, nc: Client, config: ClusterConfig, registry: Registry) -> None:
        self.nc = nc
        self.config = config
        self.registry = registry
        self.started = time.monotonic()

    async def run(
        self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float, slo: Slo = Slo(),
        report: Report | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """The request's tokens, the first from prefill, the rest from decode."""
        report = report if report is not None else Report()
        # The one place the prompt is hashed: the Conductor and prefill take these.
        hashes = hex_hashes(prompt, self.config.block_size, self.config.model_salt)
        job = Job(request_id, prompt, hashes, sampling, deadline, slo)
        placement = await self._schedule(job)
        report.placement = placement
        update = RequestUpdate(request_id=request_id, kind="finished")
        finished = False
        try:
            async for chunk in self._serve(job, placement, report):
                finished = chunk.finish_reason is not None
                yield chunk
        except DecodeRefused as e:
            update = RequestUpdate(request_id=request_id, kind="decode_refused", instance_id=placement.decode_id)
            raise Rejected(ScheduleReply(request_id=request_id, accepted=False, rejection="overloaded", reason=str(e),
                                         retry_after_s=1.0)) from e
        finally:
            if not finished:  # cancelled, failed or abandoned: free the instances' slots
                await self._publish(CANCEL, Cancel(request_id=request_id, reason="abandoned by gateway"))
            elif update.kind == "finished":
                update = RequestUpdate(request_id=request_id, kind="finished", completed=True)
            await self._publish(REQUEST_UPDATES, update)  # the Conductor closes its books

    async def _serve(self, job: Job, placement: Placement, report: Report) -> AsyncIterator[TokenChunk]:
        result = await self._prefill(job, placement)
        report.cached_tokens, report.kv_blocks = result.num_cached_tokens, result.kv_blocks
        first = TokenChunk(request_id=job.request_id, seq=0, token_ids=[result.first_token_id],
                           finish_reason=result.finish_reason)
        if result.finish_reason is not None:
            yield first
            return
        kv_blocks = kv_expected(placement.kv_blocks, result.kv_blocks)
        if kv_blocks < placement.kv_blocks:
            log.info("kv blocks not coming: decode computes them", planned=placement.kv_blocks, kv_blocks=kv_blocks)
        # Decode must accept before the first token goes out, so that a refusal
        # can still be a clean 429 rather than an error in the middle of a stream.
        sub = await self._start_decode(job, placement.decode_id, result.first_token_id, kv_blocks)
        try:
            if not job.sampling.history_dependent:  # else decode makes the first token again, with its history
                yield first
            async for chunk in self._tokens(sub, placement.decode_id, job.deadline):
                report.kv_loaded_tokens = report.kv_loaded_tokens or chunk.kv_loaded_tokens
                yield chunk
        finally:
            await sub.unsubscribe()

    async def _schedule(self, job: Job) -> Placement:
        ask = ScheduleRequest(
            request_id=job.request_id,
            prompt_len=len(job.prompt),
            block_hashes=job.block_hashes,
            max_tokens=job.sampling.max_tokens,
            deadline=job.deadline,
            slo_ttft_ms=job.slo.ttft_ms,
            slo_tbt_ms=job.slo.tbt_ms,
        )
        timeout = min(self.config.schedule_timeout_s, bus.remaining(job.deadline))
        try:
            reply = await bus.request(self.nc, SCHEDULE, ask, ScheduleReply, timeout)
        except (TimeoutError, MessageError) as e:
            raise UpstreamError(503, f"conductor unavailable: {e}") from e
        if not reply.accepted or reply.placement is None:
            raise Rejected(reply)
        log.info("scheduled", prefill=reply.placement.prefill_id, decode=reply.placement.decode_id)
        return reply.placement

    async def _prefill(self, job: Job, placement: Placement) -> PrefillResult:
        ask = PrefillRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt,
            block_hashes=job.block_hashes,
            sampling=job.sampling,
            deadline=job.deadline,
            placement=placement,
        )
        asked = bus.request(self.nc, prefill_subject(placement.prefill_id), ask, PrefillResult,
                            timeout=bus.remaining(job.deadline))
        result = await self._watch(placement.prefill_id, asked, job.deadline)
        if not result.ok:
            raise UpstreamError(502, f"prefill on {placement.prefill_id} failed: {result.error}")
        return result

    async def _start_decode(self, job: Job, decode_id: str, first: int, kv_blocks: int) -> Subscription:
        """Hand the request to its decode instance; returns the subscription its tokens
        will arrive on (the caller unsubscribes)."""
        # Subscribe before asking, so no chunk can be published before we listen.
        sub = await self.nc.subscribe(stream_subject(job.request_id))
        ask = DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt,
            first_token_id=first,
            sampling=job.sampling,
            deadline=job.deadline,
            stream_subject=stream_subject(job.request_id),
            slo_tbt_ms=job.slo.tbt_ms or self.config.slo_tbt_ms,
            block_hashes=job.block_hashes,
            kv_blocks=kv_blocks,
        )
        timeout = min(self.config.schedule_timeout_s * 2, bus.remaining(job.deadline))
        try:
            accept = await bus.request(self.nc, decode_subject(decode_id), ask, DecodeAccept, timeout)
            if accept.overloaded:
                raise DecodeRefused(f"decode instance {decode_id}: {accept.error}")
            if not accept.ok:
                raise UpstreamError(503, f"decode instance {decode_id} refused: {accept.error}")
        except (TimeoutError, MessageError) as e:
            await sub.unsubscribe()
            raise UpstreamError(503, f"decode instance {decode_id} unavailable: {e}") from e
        except BaseException:
            await sub.unsubscribe()
            raise
        return sub

    async def _tokens(self, sub: Subscription, decode_id: str, deadline: float) -> AsyncIterator[TokenChunk]:
        seq = 0
        while True:
            chunk = await self._next_chunk(sub, decode_id, deadline)
            if chunk.seq != seq:
                raise UpstreamError(502, f"token stream out of order: got chunk {chunk.seq}, expected {seq}")
            seq += 1
            if chunk.error:
                raise UpstreamError(502, f"decode on {decode_id} failed: {chunk.error}")
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def _next_chunk(self, sub: Subscription, instance_id: str, deadline: float) -> TokenChunk:
        quiet_until = time.monotonic() + self.config.token_idle_timeout_s
        while True:
            left = bus.remaining(deadline)
            if left <= 0:
                raise UpstreamError(504, "deadline exceeded while decoding")
            if time.monotonic() > quiet_until:
                raise UpstreamError(504, f"no token from {instance_id} for {self.config.token_idle_timeout_s:.0f} s")
            try:
                msg = await sub.next_msg(timeout=min(left, self.config.heartbeat_interval_s))
            except nats.errors.TimeoutError:
                self._check_alive(instance_id)
                continue
            try:
                return decode(msg.data, TokenChunk)
            except MessageError as e:
                raise UpstreamError(502, f"bad token chunk from {instance_id}: {e}") from e

    async def _watch(self, instance_id: str, work: Awaitable[T], deadline: float) -> T:
        """Await `work`, giving up as soon as `instance_id` stops beating."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.heartbeat_interval_s)
                if done:
                    try:
                        return task.result()
                    except TimeoutError as e:
                        status = 504 if bus.remaining(deadline) <= 0 else 503
                        raise UpstreamError(status, f"{instance_id}: {e}") from e
                    except MessageError as e:
                        raise UpstreamError(502, f"bad reply from {instance_id}: {e}") from e
                self._check_alive(instance_id)
        finally:
            task.cancel()

    def _check_alive(self, instance_id: str) -> None:
        now = time.monotonic()
        # An instance this gateway has not heard from yet is given the benefit of the
        # doubt until one liveness period has passed since the gateway started.
        if now - self.started > self.config.liveness_timeout_s and not self.registry.is_alive(instance_id, now):
            raise UpstreamError(503, f"instance {instance_id} stopped responding (missed heartbeats)")

    async def _publish(self, subject: str, message: Message) -> None:
        try:
            await bus.publish(self.nc, subject, message)
        except Exception as e:  # best effort: deadlines clean up what a lost message leaves
            log.warning("not sent", subject=subject, error=str(e))
