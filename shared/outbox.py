"""Token chunks on their way to the gateways, request updates on theirs to the
Conductors: one message per subject per engine step.

Each running request publishes its step's tokens from its own task. The engine wakes
every request of a step in one turn of the event loop, so the chunks queued in that
turn are one step's: the outbox sends them on the next turn, one TokenBatch per
gateway, instead of one NATS message per token. A request's chunks keep their order:
they join its gateway's batch in order, and batches leave in order on one connection.
Request updates (a step's prefills done, a step's streams closed) go the same way, as
one UpdateBatch: each Conductor takes one message for them, not one per request.
A gateway's batch goes over its token channel instead where the chunks name one that
is up (shared/token_channel.py); NATS is the way for everything else."""

from __future__ import annotations

import asyncio

import structlog

from shared import bus
from shared.messages import Message, RequestUpdate, TokenBatch, TokenChunk, UpdateBatch, encode
from shared.token_channel import Channel

log = structlog.get_logger(__name__)


class Outbox:
    def __init__(self, nc: bus.Client | bus.Link) -> None:
        self.nc = nc
        # (subject, its channel or None) → its items, in order
        self.pending: dict[tuple[str, Channel | None], list[TokenChunk | RequestUpdate]] = {}
        self.sending: asyncio.Task[None] | None = None
        self.batches = 0  # token messages sent, and the chunks in them: what batching saves
        self.chunks = 0
        self.channelled = 0  # of those batches, the ones that went over a token channel

    def send(self, subject: str, item: TokenChunk | RequestUpdate, channel: Channel | None = None) -> None:
        """Queue `item` for `subject`'s batch (chunks: its gateway's stream subject),
        sent on the loop's next turn, over `channel` if it is still ready then."""
        self.pending.setdefault((subject, channel), []).append(item)
        if self.sending is None:
            self._schedule()

    async def flush(self) -> None:
        """Wait until what is queued now has been handed to NATS or its channel."""
        while self.sending is not None:
            await asyncio.shield(self.sending)

    async def _send(self) -> None:
        # One more turn: a request whose step took an extra hop through the engine's
        # output queue still joins this step's batch.
        await asyncio.sleep(0)
        pending, self.pending = self.pending, {}
        try:
            for (subject, channel), items in pending.items():
                batch = _batch(items)
                if channel is not None and channel.send(encode(batch)):
                    self.channelled += 1
                else:
                    await bus.publish(self.nc, subject, batch)
                if isinstance(batch, TokenBatch):
                    self.batches += 1
                    self.chunks += len(items)
        except Exception as e:  # the connection closed: gateways time these streams out, deadlines close the books
            log.warning("batch not sent", error=str(e) or type(e).__name__, subjects=len(pending),
                        requests=sorted({x.request_id for items in pending.values() for x in items}))
        finally:
            self.sending = None
            if self.pending:  # queued while this batch was being sent
                self._schedule()

    def _schedule(self) -> None:
        self.sending = asyncio.get_running_loop().create_task(self._send(), name="outbox")


def _batch(items: list[TokenChunk | RequestUpdate]) -> Message:
    """One subject's items as one message (a subject carries one kind)."""
    if isinstance(items[0], RequestUpdate):
        return UpdateBatch(updates=items)  # type: ignore[arg-type]
    return TokenBatch(chunks=items)  # type: ignore[arg-type]
