"""A Conductor's digest for the others (each item aged by its wait, a beat when
quiet, nothing lost when a send fails) and its view of which peers are gone."""

from services.conductor.sync import Digest, Peers
from shared.messages import Booking, RequestUpdate


def booking(rid: str) -> Booking:
    return Booking(conductor="c0", kind="decode", request_id=rid, prompt_len=10, max_tokens=4, block_hashes=[],
                   deadline=0.0, decode_id="d0")


def test_a_digest_ages_each_item_by_its_wait_and_starts_empty_again():
    d = Digest("c0", "i0")
    d.booked(booking("r1"), now=1.000)
    d.updated(RequestUpdate(request_id="r0", kind="finished"), now=1.004)
    out = d.take(now=1.010)
    assert out.conductor == "c0"
    assert [(b.request_id, round(b.age_s, 6)) for b in out.bookings] == [("r1", 0.01)]
    assert [(u.request_id, round(u.age_s, 6)) for u in out.updates] == [("r0", 0.006)]
    assert not d.bookings and not d.updates


def test_a_digest_is_due_an_interval_after_the_last_or_as_a_beat():
    d = Digest("c0", "i0")
    assert d.due(now=0.0, wait_s=0.05, beat_s=0.5)  # never sent: its peers have not heard of it yet
    d.take(now=0.0)
    assert not d.due(now=0.4, wait_s=0.05, beat_s=0.5) and d.due(now=0.5, wait_s=0.05, beat_s=0.5)
    assert d.timer_at(sync_s=0.05, beat_s=0.5) == 0.5  # quiet: only the beat
    d.updated(RequestUpdate(request_id="r0", kind="finished"), now=0.01)
    assert not d.due(now=0.01, wait_s=0.05, beat_s=0.5)  # a handler leaves it for the next one
    assert d.due(now=0.05, wait_s=0.05, beat_s=0.5) and d.due(now=0.01, wait_s=0.0, beat_s=0.5)
    assert d.timer_at(sync_s=0.05, beat_s=0.5) == 0.1  # no handler comes: the timer, two intervals on


def test_a_digest_that_could_not_be_sent_goes_out_first_with_the_next():
    d = Digest("c0", "i0")
    d.booked(booking("r1"), now=1.0)
    failed = d.take(now=1.01)
    d.put_back(failed, now=1.01)
    d.booked(booking("r2"), now=1.02)
    out = d.take(now=1.05)
    assert [(b.request_id, round(b.age_s, 6)) for b in out.bookings] == [("r1", 0.05), ("r2", 0.03)]


def test_a_peer_is_lost_after_the_timeout_but_not_for_this_one_s_own_stall():
    peers = Peers(timeout_s=2.0)
    peers.heard("c1", "i1", now=0.0)
    peers.heard("c2", "i2", now=1.0)
    peers.unheard(1.5, now=3.0)  # this one was deaf 1.5 s of that
    assert peers.lost(now=3.0) == []
    assert peers.lost(now=3.6) == ["c1"]
    assert peers.lost(now=3.6) == []  # forgotten: lost once
    peers.heard("c1", "i1", now=4.0)  # back
    assert peers.lost(now=5.0) == ["c2"]


def test_a_peer_back_as_a_new_process_is_told_from_one_that_paused():
    peers = Peers(timeout_s=2.0)
    assert not peers.heard("c1", "i1", now=0.0)
    assert not peers.heard("c1", "i1", now=1.0)  # the same process
    assert peers.heard("c1", "i2", now=1.5) and peers.lost_total == 1  # restarted within the timeout
    assert peers.lost(now=4.0) == ["c1"]
    assert not peers.heard("c1", "i3", now=5.0)  # after a loss: already forgotten, nothing more to drop
