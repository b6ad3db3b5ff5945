"""Token chunks to the gateways and request updates to the Conductors: what one turn
of the loop queues goes as one batch per subject, in order; a lost connection costs a
log line, not the request."""

import asyncio

import msgspec

from shared.messages import RequestUpdate, TokenBatch, TokenChunk, UpdateBatch, updates_subject
from shared.outbox import Outbox

UPDATES = updates_subject("c0")


class Recorder:
    def __init__(self, fail: bool = False, slow: bool = False) -> None:
        self.sent: list[tuple[str, list[tuple[str, int]]]] = []
        self.fail, self.slow = fail, slow
        self.publishing = asyncio.Event()

    async def publish(self, subject: str, payload: bytes) -> None:
        if self.fail:
            raise ConnectionError("closed")
        self.publishing.set()
        if self.slow:  # a full buffer: nats-py waits for its flush
            await asyncio.sleep(0.05)
        if subject == UPDATES:
            updates = msgspec.json.decode(payload, type=UpdateBatch).updates
            self.sent.append((subject, [(u.request_id, u.kind) for u in updates]))
            return
        batch = msgspec.json.decode(payload, type=TokenBatch)
        self.sent.append((subject, [(c.request_id, c.seq) for c in batch.chunks]))


def chunk(request_id: str, seq: int) -> TokenChunk:
    return TokenChunk(request_id=request_id, seq=seq, token_ids=[seq])


async def step(outbox: Outbox, requests: list[tuple[str, str]], seq: int) -> None:
    """One engine step: every request's task wakes in the same turn and sends its token."""
    async def one(subject: str, request_id: str) -> None:
        outbox.send(subject, chunk(request_id, seq))

    await asyncio.gather(*(one(s, r) for s, r in requests))


async def test_one_step_goes_as_one_batch_per_gateway_and_each_request_keeps_its_order():
    nc = Recorder()
    outbox = Outbox(nc)
    requests = [("g1", "a"), ("g2", "b"), ("g1", "c")]
    for seq in range(3):
        await step(outbox, requests, seq)
        await outbox.flush()
    assert nc.sent[:2] == [("g1", [("a", 0), ("c", 0)]), ("g2", [("b", 0)])]
    assert len(nc.sent) == 6 and (outbox.batches, outbox.chunks) == (6, 9)
    a = [seq for subject, chunks in nc.sent for r, seq in chunks if r == "a"]
    assert a == [0, 1, 2]


async def test_chunks_queued_while_a_batch_is_sent_go_in_the_next():
    nc = Recorder(slow=True)
    outbox = Outbox(nc)
    outbox.send("g1", chunk("a", 0))
    await asyncio.wait_for(nc.publishing.wait(), 5)
    outbox.send("g1", chunk("a", 1))
    await asyncio.wait_for(outbox.flush(), 5)
    assert nc.sent == [("g1", [("a", 0)]), ("g1", [("a", 1)])]


async def test_a_batch_that_cannot_be_sent_is_logged_and_the_outbox_goes_on():
    outbox = Outbox(Recorder(fail=True))
    outbox.send("g1", chunk("a", 0))
    await asyncio.wait_for(outbox.flush(), 5)
    assert outbox.sending is None and outbox.batches == 0


async def test_a_turns_request_updates_go_as_one_batch_beside_the_tokens():
    nc = Recorder()
    outbox = Outbox(nc)
    outbox.send("g1", chunk("a", 3))
    outbox.send(UPDATES, RequestUpdate(request_id="a", kind="finished", completed=True))
    outbox.send(UPDATES, RequestUpdate(request_id="b", kind="prefill_done", instance_id="p0"))
    await asyncio.wait_for(outbox.flush(), 5)
    assert nc.sent == [("g1", [("a", 3)]), (UPDATES, [("a", "finished"), ("b", "prefill_done")])]
    assert (outbox.batches, outbox.chunks) == (1, 1)  # the token figures count tokens only
