"""One request through the disaggregated cluster: ask the Conductor, prefill the
prompt on one instance, decode the rest on another, and stream tokens back.

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
    REQUEST_EVENTS,
    SCHEDULE,
    Cancel,
    DecodeAccept,
    DecodeRequest,
    FinishReason,
    Heartbeat,
    Message,
    MessageError,
    PrefillRequest,
    PrefillResult,
    RequestEvent,
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


@dataclass(frozen=True)
class Event:
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_cached_tokens: int = 0
    # Prompt tokens whose KV decode loaded from the pool rather than computing.
    kv_loaded_tokens: int = 0
    # Where it ran (the first event says).
    prefill_id: str = ""
    decode_id: str = ""
    kv_blocks_sent: int = -1  # prompt blocks prefill sent toward decode (-1: not known)


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


def kv_plan(decode: Heartbeat | None, prompt_len: int, max_tokens: int, block_size: int) -> tuple[str, int]:
    """Where prefill streams a request's KV (its decode instance's node), and how many
    full blocks decode should wait for: ("", 0) when the decode instance is unknown
    here or never runs (a one-token request), so that decode computes the prompt at
    once instead of waiting kv_wait_s for blocks nobody sends."""
    if decode is None or max_tokens <= 1:
        return "", 0
    return decode.node, prompt_len // block_size


def kv_expected(planned: int, sent: int) -> int:
    """The blocks decode waits for: the planned ones, but no more than prefill says are
    on their way (`sent` < 0: it did not say). A block prefill's pool had no room for
    never comes, and waiting kv_wait_s for it would only delay the first decode step."""
    return planned if sent < 0 else min(planned, sent)


class Pipeline:
    def __init__(self, nc: Client, config: ClusterConfig, registry: Registry) -> None:
        self.nc = nc
        self.config = config
        self.registry = registry
        self.started = time.monotonic()

    async def run(
        self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float, slo: Slo = Slo()
    ) -> AsyncIterator[Event]:
        reply = await self._schedule(request_id, prompt, sampling, deadline, slo)
        finished = False
        outcome: RequestEvent = RequestEvent(request_id=request_id, kind="finished")
        try:
            kv_node, kv_blocks = kv_plan(self.registry.latest.get(reply.decode_id), len(prompt), sampling.max_tokens,
                                         self.config.block_size)
            result = await self._prefill(request_id, prompt, sampling, deadline, reply, kv_node)
            if (expected := kv_expected(kv_blocks, result.kv_blocks_sent)) < kv_blocks:
                log.info("kv blocks not coming: decode computes them", planned=kv_blocks, sent=result.kv_blocks_sent)
                kv_blocks = expected
            first = Event([result.first_token_id], result.finish_reason, result.num_cached_tokens,
                          prefill_id=reply.prefill_id, decode_id=reply.decode_id, kv_blocks_sent=result.kv_blocks_sent)
            if result.finish_reason is not None:
                finished = True
                yield first
                return
            # Decode must accept before the first token goes out, so that a refusal
            # can still be a clean 429 rather than an error in the middle of a stream.
            tbt_ms = slo.tbt_ms or self.config.slo_tbt_ms
            sub = await self._start_decode(request_id, prompt, result.first_token_id, sampling, deadline, reply, tbt_ms,
                                           kv_blocks)
            try:
                yield first
                async for event in self._tokens(sub, reply.decode_id, deadline):
                    finished = event.finish_reason is not None
                    yield event
            finally:
                await sub.unsubscribe()
        except DecodeRefused as e:
            outcome = RequestEvent(request_id=request_id, kind="decode_refused", instance_id=reply.decode_id)
            raise Rejected(ScheduleReply(request_id=request_id, accepted=False, rejection="overloaded", reason=str(e),
                                         retry_after_s=1.0)) from e
        finally:
            if not finished:  # cancelled, failed or abandoned: free the instances' slots
                await self._publish(CANCEL, Cancel(request_id=request_id, reason="abandoned by gateway"))
            elif outcome.kind == "finished":
                outcome = RequestEvent(request_id=request_id, kind="finished", completed=True)
            await self._publish(REQUEST_EVENTS, outcome)  # the Conductor closes its books

    async def _prefill(
        self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float, reply: ScheduleReply, kv_node: str
    ) -> PrefillResult:
        ask = PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            deadline=deadline,
            decode_id=reply.decode_id,
            kv_dest_node=kv_node,
            pull_from=reply.pull_from,
            pull_blocks=reply.pull_blocks,
            pull_skip=reply.pull_skip,
        )
        subject = prefill_subject(reply.prefill_id)
        result = await self._watch(
            reply.prefill_id, bus.request(self.nc, subject, ask, PrefillResult, timeout=bus.remaining(deadline)), deadline
        )
        if not result.ok:
            raise UpstreamError(502, f"prefill on {reply.prefill_id} failed: {result.error}")
        return result

    async def _schedule(
        self, request_id: str, prompt: list[int], sampling: Sampling, deadline: float, slo: Slo
    ) -> ScheduleReply:
        ask = ScheduleRequest(
            request_id=request_id,
            prompt_len=len(prompt),
            block_hashes=hex_hashes(prompt, self.config.block_size, self.config.model_salt),
            max_tokens=sampling.max_tokens,
            deadline=deadline,
            slo_ttft_ms=slo.ttft_ms,
            slo_tbt_ms=slo.tbt_ms,
        )
        timeout = min(self.config.schedule_timeout_s, bus.remaining(deadline))
        try:
            reply = await bus.request(self.nc, SCHEDULE, ask, ScheduleReply, timeout)
        except (TimeoutError, MessageError) as e:
            raise UpstreamError(503, f"conductor unavailable: {e}") from e
        if not reply.accepted:
            raise Rejected(reply)
        log.info("scheduled", prefill=reply.prefill_id, decode=reply.decode_id)
        return reply

    async def _start_decode(
        self,
        request_id: str,
        prompt: list[int],
        first: int,
        sampling: Sampling,
        deadline: float,
        reply: ScheduleReply,
        slo_tbt_ms: float,
        kv_blocks: int,
    ) -> Subscription:
        """Hand the request to its decode instance; returns the subscription its tokens
        will arrive on (the caller unsubscribes)."""
        # Subscribe before asking, so no chunk can be published before we listen.
        sub = await self.nc.subscribe(stream_subject(request_id))
        ask = DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            first_token_id=first,
            sampling=sampling,
            deadline=deadline,
            stream_subject=stream_subject(request_id),
            slo_tbt_ms=slo_tbt_ms,
            kv_blocks=kv_blocks,
        )
        timeout = min(self.config.schedule_timeout_s * 2, bus.remaining(deadline))
        try:
            accept = await bus.request(self.nc, decode_subject(reply.decode_id), ask, DecodeAccept, timeout)
            if accept.overloaded:
                raise DecodeRefused(f"decode instance {reply.decode_id}: {accept.error}")
            if not accept.ok:
                raise UpstreamError(503, f"decode instance {reply.decode_id} refused: {accept.error}")
        except (TimeoutError, MessageError) as e:
            await sub.unsubscribe()
            raise UpstreamError(503, f"decode instance {reply.decode_id} unavailable: {e}") from e
        except BaseException:
            await sub.unsubscribe()
            raise
        return sub

    async def _tokens(self, sub: Subscription, decode_id: str, deadline: float) -> AsyncIterator[Event]:
        seq = 0
        while True:
            chunk = await self._next_chunk(sub, decode_id, deadline)
            if chunk.seq != seq:
                raise UpstreamError(502, f"token stream out of order: got chunk {chunk.seq}, expected {seq}")
            seq += 1
            if chunk.error:
                raise UpstreamError(502, f"decode on {decode_id} failed: {chunk.error}")
            yield Event(chunk.token_ids, chunk.finish_reason, kv_loaded_tokens=chunk.kv_loaded_tokens)
            if chunk.finish_reason is not None:
                return

    async def _next_chunk(self, sub: Subscription, instance_id: str, deadline: float) -> TokenChunk:
        while True:
            left = bus.remaining(deadline)
            if left <= 0:
                raise UpstreamError(504, "deadline exceeded while decoding")
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
