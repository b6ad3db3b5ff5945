"""Two Conductors sharing books through Bookings, without NATS: what one places, the
other books the same way; updates close both; each counts only its own."""

import time

from services.conductor import bookings
from services.conductor.app import Conductor
from shared.config import ClusterConfig
from shared.messages import Booking, Heartbeat, RequestUpdate, ScheduleRequest

ROSTER = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))


def conductor(name: str, **kw) -> Conductor:
    c = Conductor(ClusterConfig(**{"model": "/m/tiny", "policy": "cache_aware", "admission": "none",
                                   "slo_ttft_ms": 10_000.0, "slo_tbt_ms": 1_000.0, "mode": "disaggregated",
                                   "conductors": 2, **kw}),
                  name)
    for iid, role in ROSTER:
        c.on_heartbeat(Heartbeat(instance_id=iid, role=role, node="node-0", pid=1, seq=1, sent_at=0.0), now=0.0)
    return c


def ask(rid: str, hashes: list[str], stage: str = "full") -> ScheduleRequest:
    return ScheduleRequest(request_id=rid, prompt_len=16 * len(hashes) + 5, block_hashes=hashes, max_tokens=16,
                           deadline=time.time() + 60, stage=stage)


def cross(a: Conductor, b: Conductor, now: float) -> list[Booking]:
    """Deliver a's outbox to both, as the BOOKINGS subject does (its own comes back too)."""
    sent, a.outbox = a.outbox, []
    for x in sent:
        a.on_booking(x, now)
        b.on_booking(x, now)
    return sent


def test_the_other_conductor_books_each_placement_and_both_close_it():
    a, b = conductor("conductor"), conductor("conductor-1")
    assert a.schedule(ask("r1", ["h1", "h2", "h3"]), now=0.0).accepted
    assert b.schedule(ask("r2", ["x1"]), now=0.0).accepted
    cross(a, b, 0.0)
    cross(b, a, 0.0)
    assert a.stats(0.0).booked == b.stats(0.0).booked and sum(a.stats(0.0).booked.values()) == 4
    assert (a.peer_bookings, b.peer_bookings) == (1, 1)
    # What a placed is a prefix b now routes to its holder (r2's prefill reported done:
    # what is still outstanding there counts as queued, however long ago it was booked).
    for c in (a, b):
        c.on_update(RequestUpdate(request_id="r2", kind="prefill_done"), now=0.05)
    again = b.schedule(ask("r3", ["h1", "h2", "h3", "h4"]), now=0.1)
    assert again.placement.prefill_id == a.state.placed["r1"][0]
    cross(b, a, 0.1)
    for rid in ("r1", "r2", "r3"):
        for c in (a, b):
            c.on_update(RequestUpdate(request_id=rid, kind="finished"), now=0.5)
    assert a.stats(0.5).booked == b.stats(0.5).booked and sum(a.stats(0.5).booked.values()) == 0
    assert not a.deadlines and not b.deadlines


def test_a_refusal_is_counted_where_the_request_was_placed():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    cross(a, b, 0.0)
    for c in (a, b):
        c.on_update(RequestUpdate(request_id="r1", kind="decode_refused", instance_id="d0"), now=0.1)
    assert (a.counts["wasted_prefill"], b.counts["wasted_prefill"]) == (1, 0)
    assert not b.state.placed  # its books are closed all the same


def test_a_retry_on_decode_alone_and_unknown_instances():
    a, b = conductor("conductor"), conductor("conductor-1")
    reply = a.schedule(ask("r1-retry", ["h1"], stage="decode"), now=0.0)
    (sent,) = cross(a, b, 0.0)
    assert sent.kind == "decode" and b.state.placed["r1-retry"] == ("", reply.placement.decode_id)
    stranger = Booking(conductor="conductor-2", kind="disaggregated", request_id="r9", prompt_len=40, max_tokens=4,
                       block_hashes=["z"], deadline=time.time() + 60, decode_id="d0", prefill_id="p-unknown")
    assert not bookings.knows(b.state, stranger)
    b.on_booking(stranger, 0.0)  # an instance it has not heard of yet: nothing booked
    assert "r9" not in b.state.placed and b.peer_bookings == 1


def test_a_local_prefill_books_the_decode_instances_own_queue():
    a, b = conductor("conductor", mode="colocated"), conductor("conductor-1", mode="colocated")
    assert a.schedule(ask("r1", ["h1", "h2"]), now=0.0).placement.local_prefill
    (sent,) = cross(a, b, 0.0)
    assert sent.kind == "local" and b.state.local_queued(sent.decode_id) == sent.uncached_tokens > 0


def test_a_request_booked_again_keeps_only_its_latest_booking():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    cross(a, b, 0.0)
    b.schedule(ask("r1", ["h1", "h2"]), now=0.5)  # the gateway asked again: b answered this time
    cross(b, a, 0.5)
    assert a.stats(0.5).booked == b.stats(0.5).booked and sum(a.stats(0.5).booked.values()) == 2


def test_a_lone_conductor_sends_no_bookings_and_a_planner_needs_it_alone():
    import pytest

    lone = conductor("conductor", conductors=1)
    assert lone.schedule(ask("r1", ["h1"]), now=0.0).accepted and lone.outbox == []
    with pytest.raises(ValueError, match="planner"):
        ClusterConfig(model="/m/tiny", conductors=2, planner=True)
