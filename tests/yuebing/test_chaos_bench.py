"""The chaos bench's bookkeeping: which requests a scenario counts, what is hung, when
the cluster counts as recovered, and which process a target names."""

from yuebing import client
from yuebing.bench.chaos import DEADLINE_S, Done, Fault, _is, kind_of, outcome, scenarios

FAULT = Fault("decode-0", "kill")


def test_requests_are_judged_from_the_fault_to_the_recovery():
    done = [
        Done(0.0, 1.0, "ok"),  # over before the fault: not counted
        Done(9.0, 12.0, "stream"),  # in flight at the fault
        Done(11.0, 11.5, "503"),
        Done(12.0, 14.0, "ok"),  # sent after the fault cleared: the recovery
        Done(30.0, 31.0, "ok"),  # sent after the window: not counted
    ]
    o = outcome(FAULT, done, fault_at=10.0, cleared_at=10.0, until=20.0)
    assert o.scenario == "kill decode-0" and o.requests == 3
    assert o.errors == {"stream": 1, "503": 1} and o.hung == 0 and o.recovery_s == 4.0


def test_a_request_far_past_its_deadline_is_hung():
    done = [Done(11.0, 11.0 + DEADLINE_S + 10, "connection"), Done(12.0, 13.0, "ok")]
    assert outcome(FAULT, done, fault_at=10.0, cleared_at=10.0, until=20.0).hung == 1


def test_no_success_sent_after_the_fault_cleared_is_no_recovery_and_no_error_needs_none():
    done = [Done(9.0, 16.0, "ok"), Done(11.0, 13.0, "504")]  # the success was sent during the stall
    assert outcome(Fault("nats", "stop"), done, fault_at=10.0, cleared_at=15.0, until=20.0).recovery_s is None
    assert outcome(Fault("nats", "stop"), done[:1], fault_at=10.0, cleared_at=15.0, until=20.0).recovery_s == 0.0


def test_kinds_of_results():
    assert kind_of(client.Streamed(0.0, status=200)) == "ok"
    assert kind_of(client.Streamed(0.0, status=200, error="decode died")) == "stream"
    assert kind_of(client.Streamed(0.0, status=503, error="{}")) == "503"
    assert kind_of(client.Streamed(0.0, error="ClientConnectorError")) == "connection"


def test_targets_name_processes_by_their_command_line():
    assert _is(["/venv/bin/nats-server", "-c", "x"], "nats")
    assert _is(["python", "-m", "services.gateway", "--port", "1"], "gateway")
    assert _is(["python", "-m", "services.decode", "--instance-id", "decode-0"], "decode-0")
    assert not _is(["python", "-m", "services.decode", "--instance-id", "decode-1"], "decode-0")
    assert len(scenarios()) == 18 and scenarios(("nats",), ("stop",)) == [Fault("nats", "stop")]
