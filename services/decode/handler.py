"""Serve DecodeRequests: generate every token after the first and publish them, in
order, on the request's stream subject."""

from __future__ import annotations

import asyncio

import structlog
from nats.aio.msg import Msg

from shared import bus
from shared.engine import generate
from shared.instance import Instance
from shared.messages import DecodeAccept, DecodeRequest, TokenChunk, encode
from shared.predictor import Predictor

log = structlog.get_logger(__name__)


class Decoder:
    def __init__(self, instance: Instance, engine, predictor: Predictor) -> None:
        self.instance = instance
        self.engine = engine
        self.predictor = predictor
        self.context: dict[str, int] = {}  # request id → tokens it attends to

    def predicted_tbt_s(self, extra_tokens: int) -> float:
        """Decode step time with one more request of `extra_tokens` in the batch."""
        return self.predictor.decode_step_s(len(self.context) + 1, sum(self.context.values()) + extra_tokens)

    async def on_request(self, req: DecodeRequest, msg: Msg) -> None:
        error, overloaded = "", False
        ctx = len(req.prompt_token_ids) + req.sampling.max_tokens // 2
        tbt = self.predicted_tbt_s(ctx)
        if req.slo_tbt_ms and tbt * 1e3 > req.slo_tbt_ms:
            # The Conductor predicted otherwise; we see the batch as it is now.
            error, overloaded = f"predicted TBT {tbt * 1e3:.1f} ms exceeds the SLO of {req.slo_tbt_ms:.1f} ms", True
        elif req.sampling.max_tokens < 2:
            error = "decode needs max_tokens >= 2 (the first token comes from prefill)"
        elif bus.remaining(req.deadline) <= 0:
            error = "deadline already passed"
        else:
            try:
                self.instance.run(req.request_id, self._decode(req, ctx))
            except ValueError as e:
                error = str(e)
        if error:
            log.info("decode refused", request_id=req.request_id, error=error)
        reply = DecodeAccept(request_id=req.request_id, ok=not error, error=error, overloaded=overloaded)
        await msg.respond(encode(reply))

    async def _decode(self, req: DecodeRequest, ctx: int) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        self.context[req.request_id] = ctx
        try:
            await self._generate(req)
        finally:
            del self.context[req.request_id]

    async def _generate(self, req: DecodeRequest) -> None:
        # The engine runs prompt + first token. The connector loads the prompt's blocks
        # that prefill streamed into this node's pool and the engine computes only the
        # rest: the prompt's last partial block, the first token, and any block that
        # did not arrive within kv_wait_s (see shared/kv_connector.py).
        prompt = [*req.prompt_token_ids, req.first_token_id]
        kv = {"yb_expect": req.kv_blocks, "yb_wait_s": min(self.instance.config.kv_wait_s, bus.remaining(req.deadline))}
        seq = 0
        log.info("decode start", prompt_len=len(prompt), max_tokens=req.sampling.max_tokens, kv_blocks=req.kv_blocks)
        try:
            async with asyncio.timeout(bus.remaining(req.deadline)):
                async for step in generate(
                    self.engine, req.request_id, prompt, req.sampling, req.sampling.max_tokens - 1, kv
                ):
                    if seq == 0:
                        log.info("decode kv", loaded_tokens=step.num_cached_tokens,
                                 computed_prompt_tokens=len(req.prompt_token_ids) - step.num_cached_tokens)
                    chunk = TokenChunk(
                        request_id=req.request_id, seq=seq, token_ids=step.token_ids, finish_reason=step.finish_reason,
                        kv_loaded_tokens=step.num_cached_tokens if seq == 0 else 0,
                    )
                    await bus.publish(self.instance.nc, req.stream_subject, chunk)
                    seq += 1
        except asyncio.CancelledError:
            log.info("decode cancelled", tokens_sent=seq)
            raise
        except Exception as e:
            reason = "deadline exceeded in decode" if isinstance(e, TimeoutError) else f"decode failed: {e}"
            log.warning("decode failed", error=reason)
            await bus.publish(
                self.instance.nc, req.stream_subject, TokenChunk(request_id=req.request_id, seq=seq, token_ids=[], error=reason)
            )
            return
        log.info("decode done", chunks=seq)
