from services.conductor.fairness import Load
from services.conductor.quotas import WINDOW_S, Quotas
from shared.tenants import Tenant

RPM = Tenant("acme", requests_per_minute=3)
TPM = Tenant("acme", tokens_per_minute=1000)
STREAMS = Tenant("acme", max_streams=2)
FAR = 1e9  # a deadline no test reaches


def test_requests_per_minute_refuse_the_one_past_the_bound_until_the_oldest_leaves():
    q = Quotas()
    for i, at in enumerate((0.0, 10.0, 20.0)):
        assert q.check(RPM, 1, at) is None
        q.admitted("acme", f"r{i}", 1, at, FAR)
    refused = q.check(RPM, 1, 30.0)
    assert (refused.limit, refused.bound, refused.remaining, refused.reset_s) == ("requests", 3, 0, WINDOW_S - 30)
    assert q.check(RPM, 1, WINDOW_S + 0.1) is None  # the first left the minute
    assert q.check(Tenant("beta", requests_per_minute=3), 1, 30.0) is None  # another tenant's are its own


def test_tokens_per_minute_reserve_prompt_and_max_tokens():
    q = Quotas()
    q.admitted("acme", "a", 600, 0.0, FAR)
    q.admitted("acme", "b", 300, 5.0, FAR)
    assert q.check(TPM, 100, 6.0) is None
    refused = q.check(TPM, 200, 6.0)
    assert (refused.limit, refused.remaining, refused.reset_s) == ("tokens", 100, WINDOW_S - 6)
    assert q.remaining(TPM, 6.0) == {"tokens": 100}
    assert q.check(TPM, 5000, 6.0).reset_s == WINDOW_S  # never fits: told to wait the whole window


def test_streams_close_at_their_end_or_their_deadline():
    q = Quotas()
    q.admitted("acme", "a", 1, 0.0, FAR)
    q.admitted("acme", "b", 1, 0.0, 50.0)
    assert q.check(STREAMS, 1, 1.0).limit == "streams"
    q.finished("a")
    assert q.check(STREAMS, 1, 1.0) is None
    q.admitted("acme", "c", 1, 2.0, FAR)
    assert q.check(STREAMS, 1, 3.0) is not None
    assert q.check(STREAMS, 1, 50.0) is None  # b's end was never heard: its deadline closed it
    q.finished("unknown")  # an end of nobody's is ignored
    assert "b" not in q.tenant_of  # nor kept as an open stream's


def test_a_stream_admitted_again_keeps_its_later_deadline():
    q = Quotas()
    q.admitted("acme", "a", 1, 0.0, 10.0)
    q.admitted("acme", "a", 1, 1.0, 20.0)  # its peer's booking of it, or a retry: one stream
    one = Tenant("acme", max_streams=1)
    assert q.check(one, 1, 15.0).limit == "streams" and q.check(one, 1, 20.0) is None


def test_loads_are_each_active_tenants_requests_in_flight_and_tokens_of_late():
    q = Quotas()
    q.admitted("acme", "a", 100, 0.0, FAR)
    q.admitted("acme", "b", 30, 8.0, FAR)
    q.admitted("beta", "c", 50, 9.0, FAR)
    q.finished("a", 40)  # its stream is over; its admission settles on what it took
    # Rates: acme's 70 tokens over the 9.5 s since its first; beta's 50 over a second at least.
    assert q.loads(9.5) == {"acme": Load(1, 70 / 9.5), "beta": Load(1, 50.0)}
    assert q.loads(15.0) == {"acme": Load(1, 30 / 7.0), "beta": Load(1, 50 / 6.0)}  # a left the window
    q.finished("b")
    q.finished("c")
    assert q.loads(18.5) == {"beta": Load(0, 50 / 9.5)}  # active: admitted of late
    assert q.loads(30.0) == {}


def test_a_peers_admission_counts_at_its_own_time():
    q = Quotas()
    q.admitted("acme", "mine", 1, 10.0, FAR)
    q.admitted("acme", "peer", 1, 5.0, FAR)  # heard late, admitted earlier
    q.admitted("acme", "mine2", 1, 11.0, FAR)
    assert q.check(RPM, 1, 12.0).reset_s == WINDOW_S + 5 - 12
    assert q.check(Tenant("acme"), 10**9, 12.0) is None  # no limits: never refused


def test_a_finished_request_settles_its_reservation_on_what_it_took():
    q = Quotas()
    q.admitted("acme", "a", 900, 0.0, FAR)  # prompt 100 + max_tokens 800, reserved
    assert q.check(TPM, 200, 1.0) is not None
    q.finished("a", 150)  # it took 150
    assert q.remaining(TPM, 1.0) == {"tokens": 850} and q.check(TPM, 200, 1.0) is None
    q.admitted("acme", "b", 100, 2.0, FAR)
    q.finished("b")  # not known: the reservation stands
    assert q.remaining(TPM, 2.0) == {"tokens": 750}
