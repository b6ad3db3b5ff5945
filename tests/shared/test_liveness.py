import time

import pytest

from shared.liveness import Deafness, Registry, woke_late
from shared.messages import Heartbeat


def hb(iid: str, role: str = "prefill", pid: int = 1) -> Heartbeat:
    return Heartbeat(instance_id=iid, role=role, node="n0", pid=pid, seq=1, sent_at=0.0)


def test_instances_expire_after_the_timeout():
    r = Registry(timeout_s=2.0)
    assert r.observe(hb("p1"), now=0.0) is True
    assert r.observe(hb("p1"), now=1.0) is False
    assert r.is_alive("p1", now=2.9)
    assert not r.is_alive("p1", now=3.1)
    assert r.expire(now=3.1) == ["p1"]
    assert r.observe(hb("p1"), now=4.0) is True  # back from the dead counts as new


def test_a_restart_within_the_timeout_counts_as_new():
    r = Registry(timeout_s=2.0)
    r.observe(hb("m0", "messenger"), now=0.0)
    assert r.observe(hb("m0", "messenger", pid=2), now=0.5) is True
    assert r.observe(hb("m0", "messenger", pid=2), now=1.0) is False


def test_alive_filters_by_role_in_stable_order():
    r = Registry(timeout_s=2.0)
    for iid, role in [("p2", "prefill"), ("d0", "decode"), ("p1", "prefill")]:
        r.observe(hb(iid, role), now=0.0)
    assert [h.instance_id for h in r.alive("prefill", now=1.0)] == ["p1", "p2"]
    assert [h.instance_id for h in r.alive("decode", now=5.0)] == []


def test_an_instance_silent_for_long_is_removed_by_observe_alone():
    """The gateway never calls expire: its registry must still forget the long dead."""
    r = Registry(timeout_s=2.0, forget_s=100.0)
    r.observe(hb("p1"), now=0.0)
    r.observe(hb("p2"), now=0.0)
    for t in range(10, 101, 10):  # p2 beats on, p1 went silent at 0
        r.observe(hb("p2"), now=float(t))
    assert "p1" in r.latest  # dead, not yet forgotten
    r.observe(hb("p2"), now=125.0)
    assert set(r.latest) == {"p2"} and set(r.seen_at) == {"p2"}
    assert r.observe(hb("p1"), now=126.0) is True  # beating again: new


def test_forgetting_never_comes_before_the_timeout():
    r = Registry(timeout_s=5.0, forget_s=1.0)
    assert r.forget_s == 5.0
    r.observe(hb("p1"), now=0.0)
    r.observe(hb("p2"), now=4.0)
    assert r.is_alive("p1", now=4.0)


def test_time_this_process_could_not_listen_is_no_instance_s_silence():
    r = Registry(timeout_s=2.0)
    r.observe(hb("p1"), now=0.0)
    r.observe(hb("p2"), now=0.9)
    r.unheard(3.0, now=3.5)  # deaf from 0.5 to 3.5: p1 beat 0.5 s before, p2 not while deaf
    assert r.expire(now=3.5) == [] and r.is_alive("p1", now=3.5)
    assert r.seen_at["p2"] == 3.5  # never later than now
    assert not r.is_alive("p1", now=5.1)  # silent 2 s of listening after the stall: gone


def test_a_gap_between_listens_longer_than_a_tick_and_the_grace_is_a_stall():
    d = Deafness(tick_s=0.25, grace_s=0.5)
    assert d.since_last(0.0) == 0.0  # the first listen
    assert d.since_last(0.25) == 0.0 and d.since_last(0.9) == 0.0  # a tick late: load, not a stall
    assert d.since_last(4.15) == pytest.approx(3.0)  # 3.25 s since the last: 3 s beyond the tick
    assert d.since_last(4.4) == 0.0  # counted once


def test_a_wait_is_late_only_past_its_grace():
    assert not woke_late(0.0, 0.5, 0.5, now=0.6)
    assert woke_late(0.0, 0.5, 0.5, now=1.2)
    assert not woke_late(time.monotonic() - 0.6, 0.5, 0.5)  # now: the monotonic clock


def test_a_registry_with_deafness_discounts_its_own_stalls_when_it_hears():
    r = Registry(timeout_s=2.0, deafness=Deafness(tick_s=0.05, grace_s=0.5))
    r.observe(hb("p1"), now=0.0)
    assert r.heard(0.05) == 0.0 and r.heard(0.1) == 0.0
    assert r.heard(3.1) == pytest.approx(2.95)  # a 3 s stall: p1's beat, queued, is not read yet
    assert r.is_alive("p1", now=3.1)
    assert Registry(timeout_s=2.0).heard(5.0) == 0.0  # without Deafness: nothing discounted
