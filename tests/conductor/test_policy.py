import pytest

from services.conductor.policy import Decision, Rejection, RoundRobin, make_policy
from shared.messages import Heartbeat


def hbs(role: str, *ids: str) -> list[Heartbeat]:
    return [Heartbeat(instance_id=i, role=role, node="n0", pid=1, seq=1, sent_at=0.0) for i in ids]


def test_round_robin_alternates_each_role_independently():
    rr = RoundRobin()
    picks = [rr.choose(hbs("prefill", "p0", "p1"), hbs("decode", "d0")) for _ in range(4)]
    assert [p.prefill_id for p in picks] == ["p0", "p1", "p0", "p1"]
    assert {p.decode_id for p in picks} == {"d0"}


def test_no_live_instance_is_a_rejection_with_retry():
    rr = RoundRobin()
    out = rr.choose(hbs("prefill", "p0"), [])
    assert isinstance(out, Rejection) and "decode" in out.reason and out.retry_after_s > 0
    assert isinstance(rr.choose(hbs("prefill", "p0"), hbs("decode", "d0")), Decision)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("clairvoyant")
