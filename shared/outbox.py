"""Token chunks on their way to the gateways: one message per gateway per engine step.

Each running request publishes its step's tokens from its own task. The engine wakes
every request of a step in one turn of the event loop, so the chunks queued in that
turn are one step's: the outbox sends them on the next turn, one TokenBatch per
gateway, instead of one NATS message per token. A request's chunks keep their order:
they join its gateway's batch in order, and batches leave in order on one connection."""

from __future__ import annotations

import asyncio

import structlog

from shared import bus
from shared.messages import TokenBatch, TokenChunk

log = structlog.get_logger(__name__)


class Outbox:
    def __init__(self, nc: bus.Client | bus.Link) -> None:
        self.nc = nc
        self.pending: dict[str, list[TokenChunk]] = {}  # stream subject → chunks, in order
        self.sending: asyncio.Task[None] | None = None
        self.batches = 0  # messages sent, and the chunks in them: what batching saves
        self.chunks = 0

    def send(self, subject: str, chunk: TokenChunk) -> None:
        """Queue `chunk` for the batch of `subject`'s gateway, sent on the loop's next turn."""
        self.pending.setdefault(subject, []).append(chunk)
        if self.sending is None:
            self._schedule()

    async def flush(self) -> None:
        """Wait until what is queued now has been handed to NATS."""
        while self.sending is not None:
            await asyncio.shield(self.sending)

    async def _send(self) -> None:
        # One more turn: a request whose step took an extra hop through the engine's
        # output queue still joins this step's batch.
        await asyncio.sleep(0)
        pending, self.pending = self.pending, {}
        try:
            for subject, chunks in pending.items():
                await bus.publish(self.nc, subject, TokenBatch(chunks=chunks))
                self.batches += 1
                self.chunks += len(chunks)
        except Exception as e:  # the connection closed: gateways time these streams out
            log.warning("token batch not sent", error=str(e) or type(e).__name__,
                        requests=sorted({c.request_id for chunks in pending.values() for c in chunks}))
        finally:
            self.sending = None
            if self.pending:  # queued while this batch was being sent
                self._schedule()

    def _schedule(self) -> None:
        self.sending = asyncio.get_running_loop().create_task(self._send(), name="outbox")
