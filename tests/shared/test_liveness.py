from shared.liveness import Registry
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
