"""The decode role: take a request after its prefill, double-check its TBT SLO
against the batch as it is now, then generate every token after the first and
send them, in order, to the request's gateway (over its token channel, or on its
stream subject over NATS). A request placed here
with a local prefill (serving modes colocated and conditional) is prefilled here
too, in the decode batch, and its first token is published like the rest."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.msg import Msg

from services.conductor.policy import decode_context, joining_tbt_s, tbt_exceeded
from shared import bus, tracing
from shared.config import profile_path
from shared.engine.llm import Run, Step, running
from shared.engine.outputs import LeanOutputs
from shared.engine.runtime import Handler
from shared.instance import Instance
from shared.kv.chunk_cap import KV_CHUNK_CAP
from shared.kv.plan import KV_PROMPT_TOKENS
from shared.messages import NO_TOKEN, DecodeAccept, DecodeRequest, TokenChunk, decode_subject, encode
from shared.outbox import Outbox
from shared.predictor import load_predictor
from shared.token_channel import Channel

log = structlog.get_logger(__name__)


@dataclass
class Pace:
    """One request's token gaps against the steps predicted for them: its mean TBT,
    observed and predicted, is what the SLO judges."""

    observed_s: float = 0.0
    predicted_s: float = 0.0
    last: float = 0.0

    def step(self, tokens: int, predicted_step_s: float, first: bool, now: float) -> None:
        """Tokens arrived (several at once from a consumer that lags). The first step
        loads and computes the prompt's rest: no decode step to judge."""
        if not first:
            self.observed_s += now - self.last
            self.predicted_s += max(1, tokens) * predicted_step_s
        self.last = now


def produced(req: DecodeRequest) -> int:
    """Output tokens the request's prompt already ends with: prefill's first token,
    unless decode runs the whole output (a local prefill, or a history-dependent
    request: Sampling.history_dependent)."""
    return 0 if req.sampling.history_dependent or req.first_token_id == NO_TOKEN else 1


class Decoder(Handler):
    ROLE = "decode"
    REQUEST = DecodeRequest
    subject = staticmethod(decode_subject)

    def __init__(self, instance: Instance, engine: Any) -> None:
        super().__init__(instance, engine)
        self.predictor = load_predictor(profile_path(instance.config))
        self.context: dict[str, int] = {}  # request id → the context the books count it with
        self.context_tokens = 0  # their sum
        self._predicted: tuple[tuple[int, int], float] | None = None  # (batch, step time): a step's streams ask alike
        # vLLM's engine: its streams' steps read from the engine core's outputs (the fake one has none).
        self.lean = LeanOutputs(engine) if hasattr(engine, "output_processor") else None

    def refusal(self, req: DecodeRequest) -> tuple[str, bool]:
        """Why this request cannot start here ("" if it can), and whether for load."""
        if self.instance.draining:  # placed before its heartbeat said so: another decode takes it
            return f"decode instance {self.instance.instance_id} is stopping", False
        if req.slo_tbt_ms:
            # The Conductor's own rule, on the batch as it is now rather than as predicted.
            tbt = self.instance.slowdown() * joining_tbt_s(self.predictor, len(self.context), self.context_tokens,
                                                  len(req.prompt_token_ids))
            if tbt * 1e3 > req.slo_tbt_ms:
                return tbt_exceeded(tbt, req.slo_tbt_ms / 1e3, self.instance.instance_id), True
        if req.sampling.max_tokens - produced(req) < 1:
            return "decode needs max_tokens >= 2 (the first token comes from prefill)", False
        if bus.remaining(req.deadline) <= 0:
            return "deadline already passed", False
        return "", False

    async def on_request(self, req: DecodeRequest, msg: Msg) -> None:
        error, overloaded = self.refusal(req)
        if not error:
            try:
                self.instance.run(req.request_id, self._decode(req))
            except ValueError as e:
                error = str(e)
        if error:
            log.info("decode refused", request_id=req.request_id, error=error)
        reply = DecodeAccept(request_id=req.request_id, ok=not error, error=error, overloaded=overloaded)
        await msg.respond(encode(reply))

    async def _decode(self, req: DecodeRequest) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id, tenant=req.tenant)
        context = decode_context(len(req.prompt_token_ids), req.sampling.max_tokens)
        self.context[req.request_id] = context
        self.context_tokens += context
        try:
            with tracing.span("decode", req.request_id, instance=self.instance.instance_id,
                              kv_blocks=req.kv_blocks, tenant=req.tenant):
                await self._generate(req)
        finally:
            del self.context[req.request_id]
            self.context_tokens -= context

    def predicted_step_s(self) -> float:
        """A step of the batch as the books hold it now."""
        batch = (len(self.context), self.context_tokens)
        if self._predicted is None or self._predicted[0] != batch:
            self._predicted = (batch, self.predictor.decode_step_s(*batch))
        return self._predicted[1]

    async def _generate(self, req: DecodeRequest) -> None:
        # The engine runs prompt + first token. The connector loads the prompt's blocks
        # (its tail too) that prefill streamed into this node's pool and the engine
        # computes only the rest: the first token, and any block that
        # did not arrive within kv_wait_s (see shared/kv/connector.py). A request whose
        # sampling depends on its own output runs from the prompt alone instead, for
        # the whole output, so that its history holds every token (Sampling.history_dependent).
        # A local prefill (first_token_id NO_TOKEN) runs from the prompt, as plain vLLM does.
        done = produced(req)
        prompt = [*req.prompt_token_ids, req.first_token_id][: len(req.prompt_token_ids) + done]
        config = self.instance.config
        kv = {"kv_blocks": req.kv_blocks, "kv_wait_s": min(config.kv_wait_s, bus.remaining(req.deadline)),
              "kv_hashes": req.block_hashes, KV_PROMPT_TOKENS: len(req.prompt_token_ids)}
        if cap := config.prompt_chunk_tokens("decode"):  # its stream's TBT, on an engine launched for either role
            kv[KV_CHUNK_CAP] = cap
        # The gateway's token channel (opening now, if it is not open yet, while the prompt's KV loads).
        channel = self.instance.channels.get(req.stream_channel, req.stream_key)
        chunks = Chunks(req, self.instance.outbox, self.predicted_step_s, channel)
        log.info("decode start", prompt_len=len(prompt), max_tokens=req.sampling.max_tokens, kv_blocks=req.kv_blocks)
        try:
            async with asyncio.timeout(bus.remaining(req.deadline)):
                async with running(self.engine, req.request_id, prompt, req.sampling, req.sampling.max_tokens - done,
                                   chunks.send, kv, done, req.sampling.n, prompt_logprobs=req.first_token_id == NO_TOKEN,
                                   cache_salt=req.cache_salt, lean=self.lean) as run:
                    await self._first_step(req, run, chunks)
                    await run.wait()
        except asyncio.CancelledError:
            log.info("decode cancelled", tokens_sent=chunks.seq, handed_on=self.instance.draining)
            if self.instance.draining:  # the instance stops: the gateway continues the stream on another
                chunks.fail(f"decode instance {self.instance.instance_id} stopped (drain_timeout_s passed): "
                            "continue elsewhere")
            raise
        except Exception as e:
            reason = "deadline exceeded in decode" if isinstance(e, TimeoutError) else f"decode failed: {e}"
            log.warning("decode failed", error=reason)
            chunks.fail(reason)
            return
        self.instance.load.calibration.add(chunks.pace.observed_s, chunks.pace.predicted_s, time.monotonic())
        log.info("decode done", chunks=chunks.seq)

    async def _first_step(self, req: DecodeRequest, run: Run, chunks: Chunks) -> None:
        """The first step: the wait for the prompt's KV (its load, and the computing
        of what did not arrive) is all in it, so it has a span of its own."""
        with tracing.span("decode.kv_wait", req.request_id, kv_blocks=req.kv_blocks) as span:
            await run.started
            if chunks.seq:
                span.set_attribute("yuebing.loaded_tokens", chunks.loaded_tokens)
                log.info("decode kv", loaded_tokens=chunks.loaded_tokens,
                         computed_prompt_tokens=len(req.prompt_token_ids) - chunks.loaded_tokens)


class Chunks:
    """A request's steps onto its stream, as the engine's output task hands them on
    (shared/engine/llm.py, Run): a chunk each, numbered, into the outbox, over the
    gateway's token channel if it is ready for the first chunk and while it stays so
    (else over NATS to the end: a stream's chunks take one way at a time)."""

    def __init__(self, req: DecodeRequest, outbox: Outbox, predicted_step_s: Callable[[], float],
                 channel: Channel | None = None) -> None:
        self.request_id, self.subject = req.request_id, req.stream_subject
        self.outbox, self.predicted_step_s = outbox, predicted_step_s
        self.channel = channel
        self.pace = Pace()
        self.seq = 0  # the next chunk's number
        self.loaded_tokens = 0  # prompt tokens whose KV was loaded, as the first step says

    def send(self, step: Step) -> None:
        if step.index == 0:  # the outputs step together: one paces the request
            self.pace.step(len(step.token_ids), self.predicted_step_s(), first=not self.pace.last, now=time.monotonic())
        if self.seq == 0:
            self.loaded_tokens = step.num_cached_tokens
        chunk = TokenChunk(request_id=self.request_id, seq=self.seq, token_ids=step.token_ids,
                           finish_reason=step.finish_reason, kv_loaded_tokens=self.loaded_tokens if self.seq == 0 else 0,
                           logprobs=step.logprobs or [], index=step.index, prompt_logprobs=step.prompt_logprobs or [])
        self._send(chunk)

    def fail(self, error: str) -> None:
        """The stream's last chunk: why it ends here."""
        self._send(TokenChunk(request_id=self.request_id, seq=self.seq, token_ids=[], error=error))

    def _send(self, chunk: TokenChunk) -> None:
        if self.channel is not None and not self.channel.ready:
            self.channel = None
        self.outbox.send(self.subject, chunk, self.channel)
        self.seq += 1
