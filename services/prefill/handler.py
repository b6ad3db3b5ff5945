"""The prefill role: compute a prompt and its first token, saving the prompt's KV
into the node pool as it goes (the messenger streams it on to decode's node), and
answer with the first token."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from nats.aio.msg import Msg

from shared import bus, tracing
from shared.engine.llm import generate
from shared.engine.runtime import Handler
from shared.messages import (
    MessageError,
    MessengerAck,
    MessengerCommand,
    PrefillRequest,
    PrefillResult,
    RequestUpdate,
    encode,
    messenger_subject,
    prefill_subject,
    updates_subject,
)

log = structlog.get_logger(__name__)
PULL_ASK_TIMEOUT_S = 1.0  # a holder that does not answer this fast is not worth waiting for


def is_client_error(e: Exception) -> bool:
    """vLLM's own verdict that the request is at fault (e.g. a schema its grammar
    backend cannot take), as its OpenAI server would answer with a 400."""
    from vllm.exceptions import VLLMClientError

    return isinstance(e, VLLMClientError)


class Prefiller(Handler):
    ROLE = "prefill"
    REQUEST = PrefillRequest
    subject = staticmethod(prefill_subject)

    async def on_request(self, req: PrefillRequest, msg: Msg) -> None:
        try:
            if self.instance.draining:  # placed before its heartbeat said so: the gateway places it again
                raise ValueError(self._stopping())
            self.instance.run(req.request_id, self._prefill(req, msg))
        except ValueError as e:
            await msg.respond(encode(PrefillResult(request_id=req.request_id, ok=False, error=str(e))))

    def _stopping(self) -> str:
        return f"prefill instance {self.instance.instance_id} is stopping"

    async def _prefill(self, req: PrefillRequest, msg: Msg) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id, tenant=req.tenant)
        log.info("prefill start", prompt_len=len(req.prompt_token_ids), decode=req.placement.decode_id)
        try:
            async with asyncio.timeout(bus.remaining(req.deadline)):
                with tracing.span("prefill", req.request_id, instance=self.instance.instance_id,
                                  prompt_tokens=len(req.prompt_token_ids), tenant=req.tenant):
                    result = await self._first_token(req)
        except TimeoutError:
            result = PrefillResult(request_id=req.request_id, ok=False, error="deadline exceeded in prefill")
        except asyncio.CancelledError:
            log.info("prefill cancelled", handed_on=self.instance.draining)
            if self.instance.draining:  # the instance stops: the gateway places the prompt again now
                await msg.respond(encode(PrefillResult(request_id=req.request_id, ok=False, error=self._stopping())))
            raise
        except Exception as e:
            invalid = is_client_error(e)
            log.warning("prefill refused the request", error=str(e)) if invalid else log.exception("prefill failed")
            result = PrefillResult(request_id=req.request_id, ok=False, error=f"prefill failed: {e}", invalid=invalid)
        log.info("prefill done", ok=result.ok, cached=result.num_cached_tokens, kv_blocks=result.kv_blocks,
                 error=result.error or None)
        await msg.respond(encode(result))
        update = RequestUpdate(request_id=req.request_id, kind="prefill_done", instance_id=self.instance.instance_id)
        self.instance.outbox.send(updates_subject(req.placement.conductor), update)  # with the step's other prefills, one message

    async def _pull(self, req: PrefillRequest) -> int:
        """Ask the messenger of the placement's `pull_from` node to send the prompt's
        first blocks to this node's pool; returns how many leading blocks are coming."""
        placement = req.placement
        hashes = req.block_hashes[: placement.pull_blocks]
        ask = MessengerCommand(op="send", node=self.instance.node, hashes=hashes, skip=placement.pull_skip)
        subject = messenger_subject(placement.pull_from)
        try:
            ack = await bus.request(self.instance.nc, subject, ask, MessengerAck, timeout=PULL_ASK_TIMEOUT_S)
        except (TimeoutError, MessageError) as e:
            log.warning("pull failed: computing instead", holder=placement.pull_from, error=str(e))
            return 0
        log.info("pull", holder=placement.pull_from, asked=len(hashes), kv_blocks=ack.blocks, error=ack.error or None)
        return ack.blocks if ack.ok else 0

    async def _kv_params(self, req: PrefillRequest) -> dict[str, Any]:
        """What the KV connector is told (shared/kv/connector.py): stream each saved
        layer to decode's node, and wait for the blocks a pull brings first."""
        placement = req.placement
        params: dict[str, Any] = {"kv_dest": placement.decode_node, "kv_hashes": req.block_hashes}
        if trace := tracing.headers():  # the messenger's span of the push joins the request's trace
            params["kv_trace"] = trace
        if placement.pull_from and placement.pull_blocks and req.sampling.prompt_logprobs is None:
            pulled = await self._pull(req)
            if pulled:  # wait for them (never past the deadline), then compute the rest
                params.update(kv_blocks=pulled, kv_wait_s=min(self.instance.config.kv_wait_s, bus.remaining(req.deadline)))
        return params

    async def _first_token(self, req: PrefillRequest) -> PrefillResult:
        # The connector loads the prompt's leading blocks found in this node's pool,
        # saves the others into it layer by layer as they are computed, and the
        # messenger streams them to the decode node meanwhile.
        kv = await self._kv_params(req)
        steps = [s async for s in generate(self.engine, req.request_id, req.prompt_token_ids, req.sampling, 1, kv,
                                           prompt_logprobs=True, cache_salt=req.cache_salt)]
        token_ids = [t for s in steps for t in s.token_ids]
        logprobs = [lp for s in steps for lp in s.logprobs or ()]
        if len(token_ids) != 1:
            raise RuntimeError(f"engine returned {len(token_ids)} tokens for a 1-token prefill")
        reason = steps[-1].finish_reason
        # We cap the engine at one token; "length" is the request's own end only if it asked for one.
        finish = "stop" if reason == "stop" else ("length" if req.sampling.max_tokens == 1 else None)
        return PrefillResult(
            request_id=req.request_id,
            ok=True,
            first_token_id=token_ids[0],
            finish_reason=finish,
            num_cached_tokens=steps[-1].num_cached_tokens,
            kv_blocks=int((steps[-1].kv_transfer_params or {}).get("kv_blocks", -1)),
            first_logprobs=logprobs[0] if logprobs else None,
            prompt_logprobs=next((s.prompt_logprobs for s in steps if s.prompt_logprobs), []),
        )
