"""Two Conductors sharing books through their digests, without NATS: what one places,
the other books the same way; a request's updates reach the Conductor that placed
it, and through its digest the other; each counts only its own."""

import time

import msgspec

from services.conductor import bookings
from services.conductor.app import Conductor
from shared.config import ClusterConfig
from shared.messages import BookDigest, Booking, Heartbeat, RequestUpdate, ScheduleRequest

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
    """a's digest to b, through JSON as BOOK_DIGESTS carries it; returns its bookings."""
    digest = msgspec.json.decode(msgspec.json.encode(a.digest.take(now)), type=BookDigest)
    b.on_digest(digest, now)
    return digest.bookings


def update(owner: Conductor, rid: str, kind: str, now: float, **kw) -> None:
    """A request's update, on the subject of the Conductor that placed it."""
    owner.on_update(RequestUpdate(request_id=rid, kind=kind, **kw), now)


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
    update(b, "r2", "prefill_done", now=0.05)
    again = b.schedule(ask("r3", ["h1", "h2", "h3", "h4"]), now=0.1)
    assert again.placement.prefill_id == a.state.placed["r1"][0] and again.placement.conductor == "conductor-1"
    cross(b, a, 0.1)
    update(a, "r1", "finished", now=0.5)
    for rid in ("r2", "r3"):
        update(b, rid, "finished", now=0.5)
    cross(a, b, 0.5)
    cross(b, a, 0.5)
    assert a.stats(0.5).booked == b.stats(0.5).booked and sum(a.stats(0.5).booked.values()) == 0
    assert not a.deadlines and not b.deadlines


def test_a_refusal_is_counted_where_the_request_was_placed():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    update(a, "r1", "decode_refused", now=0.1, instance_id="d0")
    cross(a, b, 0.1)
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


def test_an_update_is_dated_where_it_happened_not_when_the_digest_came():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    cross(a, b, 0.002)
    update(a, "r1", "prefill_done", now=0.1)
    cross(a, b, 0.108)  # it waited 8 ms in a's digest
    (decode,) = [d for d in ("d0", "d1") if "r1" in b.state.decode.get(d, {})]
    # Decoding began at 0.1 for both: b's time model learns from the same span as a's.
    assert abs(b.state.decode[decode]["r1"].start - 0.1) < 1e-9
    assert a.state.decode[decode]["r1"].start == 0.1


def test_a_lost_conductor_s_placements_leave_the_books_and_a_stall_of_its_own_is_no_loss():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    b.schedule(ask("r2", ["x1"]), now=0.0)
    cross(a, b, 0.0)
    b.heard(0.0)
    b.heard(5.0)  # b's own loop stalled 5 s: a's silence meanwhile is not a's
    b.forget_lost_peers(5.0)
    assert "r1" in b.state.placed
    b.forget_lost_peers(5.0 + b.config.liveness_timeout_s + 0.1)  # no digest from a since: a is gone
    assert "r1" not in b.state.placed and "r2" in b.state.placed and not b.placed_by


def test_a_conductor_restarted_within_the_timeout_leaves_only_its_new_placements():
    a, b = conductor("conductor"), conductor("conductor-1")
    a.schedule(ask("r1", ["h1"]), now=0.0)
    cross(a, b, 0.0)
    again = conductor("conductor")  # a's process restarted: its updates so far are lost with it
    again.schedule(ask("r2", ["h2"]), now=0.5)
    cross(again, b, 0.5)
    assert "r1" not in b.state.placed and "r2" in b.state.placed
    assert b.placed_by == {"r2": "conductor"}


def test_a_lone_conductor_keeps_no_digest_and_a_planner_needs_it_alone():
    import pytest

    lone = conductor("conductor", conductors=1)
    assert lone.schedule(ask("r1", ["h1"]), now=0.0).accepted and lone.digest is None
    with pytest.raises(ValueError, match="planner"):
        ClusterConfig(model="/m/tiny", conductors=2, planner=True)
