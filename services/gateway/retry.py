"""Retry and migration within a request's deadline: the pure parts the pipeline
(services/gateway/pipeline.py) runs its retries with.

A request may go through several placements ("attempts"), at most
`ClusterConfig.max_attempts` in all: the first; another prefill instance when its
prefill dies or stalls before the first token; another decode instance when its
decode refuses it (the TBT double check) or cannot be reached; and another decode
that continues the stream when its decode dies mid-stream.

Each attempt has an id of its own (`attempt_id`), and that id is the only name the
cluster knows it by: the stream subject its tokens arrive on, the key a Cancel
aborts, the Conductor's books. So a late chunk of a dead attempt can never
interleave with the next one's, and cancelling an abandoned attempt never touches
the one that replaced it.

A continuation (`continuation`) is a decode of the prompt plus the tokens the
client already has, from the last of them: exact for every sampling setting whose
next token depends only on the tokens before it (greedy output equals an
uninterrupted run's). Output-history-dependent sampling
(`Sampling.history_dependent`: presence/frequency penalties, bad words, structured
output) would count the streamed tokens as prompt, so such a stream is not
continued: it ends with a clean 503 error chunk (before its first token it can
still start again elsewhere, exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter

from shared import bus
from shared.block_hash import hex_hashes
from shared.messages import NO_TOKEN, ModeRecord, Placement, RateLimit, RequestUpdate, Sampling, updates_subject

log = structlog.get_logger(__name__)
Stage = Literal["prefill", "decode", "migration"]
STAGES: tuple[Stage, ...] = ("prefill", "decode", "migration")
GIVE_UP_REASONS = ("attempts", "deadline", "no_instance", "history_dependent")


def attempt_id(request_id: str, number: int) -> str:
    """The cluster's name for attempt `number` (1: the first) of a request: the
    request id itself, then `<id>-a2`, `<id>-a3`, ... (NATS subject-safe, as the
    gateway's request ids are: shared/config.py ID_PATTERN)."""
    return request_id if number <= 1 else f"{request_id}-a{number}"


@dataclass(frozen=True)
class DecodeOrder:
    """What a decode instance is asked to run: `prompt` then `first_token_id`, with
    `sampling` for the rest (its max_tokens counts `first_token_id`, as
    DecodeRequest's does). The prompt's first `kv_blocks` blocks were sent to node
    `kv_node`'s pool by prefill: a decode there waits for them; elsewhere they are
    computed. `continued`: output tokens already streamed that are now part of
    `prompt` (0: the request's own first decode)."""

    prompt: list[int]
    first_token_id: int
    sampling: Sampling
    block_hashes: list[str]
    kv_node: str
    kv_blocks: int
    continued: int = 0

    def kv_blocks_on(self, node: str) -> int:
        """The blocks a decode on `node` waits for (it loads whatever its pool holds anyway)."""
        return self.kv_blocks if node == self.kv_node else 0


class NotContinuable(Exception):
    """A stream that cannot be continued elsewhere exactly."""


def continuation(base: DecodeOrder, streamed: list[int], block_size: int, salt: bytes) -> DecodeOrder | None:
    """The order that continues `base` once the client has `streamed` (its output
    so far, prefill's first token included unless history-dependent); None when
    nothing is left to generate. The streamed tokens but the last join the prompt
    (their KV is computed again: decode saves none; the prompt's own blocks load
    from the pool where they are), the last is the new first token, and max_tokens
    and min_tokens shrink by what the prompt took."""
    if base.first_token_id == NO_TOKEN and streamed and not base.sampling.history_dependent:
        base = replace(base, first_token_id=streamed[0])  # a local prefill's: as if prefill had made it
    if base.sampling.history_dependent:
        if streamed:
            raise NotContinuable("its sampling depends on its own output (penalties, bad words or structured output), "
                                 "which a continuation elsewhere would count as prompt")
        return base  # nothing went out yet: decode runs again from the prompt alone
    done = len(streamed) - 1  # streamed[0] is base.first_token_id
    if done <= 0:
        return base
    left = base.sampling.max_tokens - done  # counts the new first token, which the client has
    if left < 2:
        return None
    prompt = [*base.prompt, *streamed[:-1]]
    sampling = msgspec.structs.replace(base.sampling, max_tokens=left, min_tokens=max(0, base.sampling.min_tokens - done))
    return replace(base, prompt=prompt, first_token_id=streamed[-1], sampling=sampling,
                   block_hashes=hex_hashes(prompt, block_size, salt), continued=base.continued + done)


def with_decode(placement: Placement | None, decode: Placement) -> Placement:
    """The request's placement once `decode` (a decode-only placement) replaced its decode."""
    if placement is None:
        return decode
    return msgspec.structs.replace(placement, decode_id=decode.decode_id, decode_node=decode.decode_node)


class RetryMetrics:
    """The gateway's retry counters; `register` puts them on the gateway's page."""

    def __init__(self) -> None:
        self.retries = Counter("yuebing_gateway_retries", "Attempts started after a failure, by stage "
                               "(prefill: prefill died or stalled; decode: decode refused or unreachable; "
                               "migration: decode died mid-stream)", ["stage"], registry=None)
        self.given_up = Counter("yuebing_gateway_retries_given_up", "Requests failed after a retryable failure, "
                                "by stage and why no further attempt", ["stage", "reason"], registry=None)
        for stage in STAGES:  # every series from the start: a rate over a missing series reads as nothing
            self.retries.labels(stage)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.retries)
        registry.register(self.given_up)


@dataclass
class Attempt:
    """One placement of a request, with the update the Conductor gets when it ends."""

    id: str
    placement: Placement
    predicted_ttft_ms: float = 0.0
    mode: ModeRecord | None = None  # the Conductor's serving-mode decision
    route: str = ""  # the Conductor's CPP-or-single decision (ScheduleReply.route)
    limits: list[RateLimit] = field(default_factory=list)  # its tenant's quotas after it (ScheduleReply.limits)
    finished: bool = False  # its last token reached the client
    update: RequestUpdate | None = None  # when it ends; None: "finished", completed if `finished`

    @property
    def updates(self) -> str:
        """Where its updates go: the Conductor that placed it."""
        return updates_subject(self.placement.conductor)

    def closing(self, whole: bool, tokens: int = -1) -> RequestUpdate:
        """What the Conductor hears when this attempt ends; `whole`: it decoded the
        whole output (a continuation's time would teach t_d a partial decode);
        `tokens`: the request's prompt and what it streamed (its quota settles on them)."""
        if self.update is not None:
            return self.update
        return RequestUpdate(request_id=self.id, kind="finished", completed=self.finished and whole, tokens=tokens)


@dataclass
class Tries:
    """A request's attempts: how many so far, the instances that failed it, and
    the one running now."""

    request_id: str
    max_attempts: int
    metrics: RetryMetrics
    count: int = 0
    avoid: list[str] = field(default_factory=list)
    current: Attempt | None = None

    def next_id(self) -> str:
        self.count += 1
        return attempt_id(self.request_id, self.count)

    def may_retry(self, stage: Stage, error: Exception, deadline: float) -> bool:
        """Whether another attempt may start; counts and logs the request's end if not."""
        reason = "attempts" if self.count >= self.max_attempts else "deadline" if bus.remaining(deadline) <= 0 else ""
        if reason:
            self.give_up(stage, reason, error)
        return not reason

    def retrying(self, stage: Stage, error: Exception, failed: str) -> None:
        if failed and failed not in self.avoid:
            self.avoid.append(failed)
        self.metrics.retries.labels(stage).inc()
        log.warning("retrying", request_id=self.request_id, stage=stage, failed_attempt=self.current.id if self.current else None,
                    failed_instance=failed, attempt=self.count + 1, max_attempts=self.max_attempts, avoid=self.avoid,
                    error=str(error))

    def give_up(self, stage: Stage, reason: str, error: Exception) -> None:
        self.metrics.given_up.labels(stage, reason).inc()
        log.warning("not retried", request_id=self.request_id, stage=stage, reason=reason, attempts=self.count,
                    error=str(error))
