"""Serve PrefillRequests: compute the prompt, return the first token."""

from __future__ import annotations

import asyncio

import structlog
from nats.aio.msg import Msg

from shared import bus
from shared.block_hash import hex_hashes
from shared.engine import generate
from shared.instance import Instance
from shared.messages import (
    REQUEST_EVENTS,
    MessageError,
    MessengerAck,
    MessengerCommand,
    PrefillRequest,
    PrefillResult,
    RequestEvent,
    encode,
    messenger_subject,
)

log = structlog.get_logger(__name__)


class Prefiller:
    def __init__(self, instance: Instance, engine) -> None:
        self.instance = instance
        self.engine = engine

    async def on_request(self, req: PrefillRequest, msg: Msg) -> None:
        try:
            self.instance.run(req.request_id, self._prefill(req, msg))
        except ValueError as e:
            await msg.respond(encode(PrefillResult(request_id=req.request_id, ok=False, error=str(e))))

    async def _prefill(self, req: PrefillRequest, msg: Msg) -> None:
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        log.info("prefill start", prompt_len=len(req.prompt_token_ids), decode=req.decode_id)
        try:
            async with asyncio.timeout(bus.remaining(req.deadline)):
                result = await self._first_token(req)
        except TimeoutError:
            result = PrefillResult(request_id=req.request_id, ok=False, error="deadline exceeded in prefill")
        except asyncio.CancelledError:
            log.info("prefill cancelled")
            raise
        except Exception as e:
            log.exception("prefill failed")
            result = PrefillResult(request_id=req.request_id, ok=False, error=f"prefill failed: {e}")
        log.info("prefill done", ok=result.ok, cached=result.num_cached_tokens, error=result.error or None)
        await msg.respond(encode(result))
        event = RequestEvent(request_id=req.request_id, kind="prefill_done", instance_id=self.instance.instance_id)
        await bus.publish(self.instance.nc, REQUEST_EVENTS, event)

    async def _pull(self, req: PrefillRequest) -> int:
        """Ask the messenger of node `req.pull_from` to send the prompt's first blocks
        to this node's pool; returns how many leading blocks are on their way."""
        config = self.instance.config
        bs = config.block_size
        hashes = hex_hashes(req.prompt_token_ids[: req.pull_blocks * bs], bs, config.model_salt)
        ask = MessengerCommand(op="send", node=self.instance.node, hashes=hashes, skip=req.pull_skip)
        try:
            ack = await bus.request(self.instance.nc, messenger_subject(req.pull_from), ask, MessengerAck, timeout=1.0)
        except (TimeoutError, MessageError) as e:
            log.warning("pull failed: computing instead", holder=req.pull_from, error=str(e))
            return 0
        log.info("pull", holder=req.pull_from, asked=len(hashes), coming=ack.blocks, error=ack.error or None)
        return ack.blocks if ack.ok else 0

    async def _first_token(self, req: PrefillRequest) -> PrefillResult:
        # The connector loads the prompt's leading blocks found in this node's pool,
        # saves the others into it layer by layer as they are computed, and the
        # messenger streams them to the decode node meanwhile.
        kv: dict[str, object] = {"yb_dest": req.kv_dest_node}
        if req.pull_from and req.pull_blocks:
            coming = await self._pull(req)
            if coming:  # wait for them (never past the deadline), then compute the rest
                kv.update(yb_expect=coming, yb_wait_s=min(self.instance.config.kv_wait_s, bus.remaining(req.deadline)))
        steps = [s async for s in generate(self.engine, req.request_id, req.prompt_token_ids, req.sampling, 1, kv)]
        token_ids = [t for s in steps for t in s.token_ids]
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
            kv_blocks_sent=int((steps[-1].kv_transfer_params or {}).get("yb_coming", -1)),
        )
