"""Placements as Bookings: one Conductor's decision in the form every Conductor books.

Several Conductors share the `conductor` queue group, each answering some of the
schedule requests. Heartbeats and KV events reach all of them, but a placement and
its request's updates only the one that made it. So each Conductor books its own
decisions through `book` and sends them to the others in its digests (sync.py), and
the others book them the same way: all hold the same books, and admission on any of
them sees every request placed, one sync interval late at most.

Two Conductors may still both admit onto the last headroom of one decode instance
before a digest crosses. The decode instance's own check on arrival is the
arbiter: it refuses the second (`decode_refused`), which counts as a wasted prefill
and is placed again on another decode instance.
"""

from __future__ import annotations

from services.conductor.policy import Decision, PrefillChoice, Request
from services.conductor.state import ClusterState
from shared.messages import Booking


def disaggregated(conductor: str, req: Request, hashes: list[str], deadline: float, out: Decision) -> Booking:
    p = out.prefill
    return Booking(conductor=conductor, kind="disaggregated", request_id=req.request_id, prompt_len=req.prompt_len,
                   max_tokens=req.max_tokens, block_hashes=hashes, deadline=deadline, decode_id=out.decode_id,
                   prefill_id=p.instance_id, ttft_s=p.ttft_s, tbt_s=out.tbt_s, cached_blocks=p.cached_blocks,
                   pull_from=p.pull_from, pull_blocks=p.pull_blocks)


def local(conductor: str, req: Request, hashes: list[str], deadline: float, decode_id: str, uncached_tokens: int,
          ttft_s: float) -> Booking:
    return Booking(conductor=conductor, kind="local", request_id=req.request_id, prompt_len=req.prompt_len,
                   max_tokens=req.max_tokens, block_hashes=hashes, deadline=deadline, decode_id=decode_id,
                   ttft_s=ttft_s, uncached_tokens=uncached_tokens)


def decode_only(conductor: str, req: Request, deadline: float, decode_id: str) -> Booking:
    return Booking(conductor=conductor, kind="decode", request_id=req.request_id, prompt_len=req.prompt_len,
                   max_tokens=req.max_tokens, block_hashes=[], deadline=deadline, decode_id=decode_id)


def knows(state: ClusterState, b: Booking) -> bool:
    """Whether the books know the booking's instances (a Conductor just started may
    not have heard them yet: their heartbeats will bring them, without this request)."""
    host_known = b.decode_id in state.decode or b.decode_id in state.prefill  # a prefill instance decodes when degraded
    return host_known and (b.kind != "disaggregated" or b.prefill_id in state.prefill)


def book(state: ClusterState, b: Booking, now: float, conditional: bool = False) -> None:
    """Charge the books for the placement. `conditional`: a decode engine keeps the
    blocks it loads (serving mode conditional), so the prefix index counts them. A
    request booked again (the gateway asked twice) keeps only its latest booking."""
    if b.request_id in state.placed:
        state.finished(b.request_id, now)
    req = Request(b.request_id, b.prompt_len, len(b.block_hashes), b.max_tokens, slo_ttft_s=0.0, slo_tbt_s=0.0)
    if b.kind == "disaggregated":
        choice = PrefillChoice(b.prefill_id, b.ttft_s, b.cached_blocks, b.pull_from, b.pull_blocks)
        state.assign(req, b.block_hashes, Decision(choice, b.decode_id, b.tbt_s), now)
        if conditional:
            state.index.insert(b.decode_id, b.block_hashes)
    elif b.kind == "local":
        state.assign_local(req, b.block_hashes, b.decode_id, b.uncached_tokens, b.ttft_s, now)
    else:
        state.assign_decode(req, b.decode_id, now)


def per_instance(state: ClusterState) -> dict[str, int]:
    """Requests in the books of each instance: its prefill queue and its decode batch."""
    counts = {iid: len(book.outstanding) for iid, book in state.prefill.items()}
    for iid, items in state.decode.items():
        counts[iid] = counts.get(iid, 0) + len(items)
    return counts
