"""Chaos against a live `--nodes 2` cluster (two prefill and two decode instances:
the shared two-of-each layout, after its other tests) under steady streaming load:
the gateway, the Conductor, nats-server and a messenger killed (SIGKILL) once, and
one of each of the Conductor, a messenger and a decode service stalled (SIGSTOP past
the liveness timeout), one after another. For each: no request runs past its deadline,
the errors clients see are only those EXPECTED_ERRORS (yuebing/bench/chaos.py) lists
for that process, and requests succeed again (the time it took is printed).

`yuebing bench chaos` runs the whole matrix (every process killed and stalled); the
suite runs this part of it, which restarts no engine: the kills of an engine's
service, prefill's or decode's, and of a decode engine are tests/e2e/test_degraded.py's
(and test_migration.py's, on this layout)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path

import pytest

from yuebing.bench.chaos import DEADLINE_S, EXPECTED_ERRORS, HEADER, ChaosSpec, Fault, chaos, row

pytestmark = pytest.mark.e2e


SUITE_FAULTS = [Fault(target, "kill") for target in ("gateway", "conductor", "nats", "messenger-1")] \
    + [Fault(target, "stop") for target in ("conductor", "messenger-0", "decode-0")]


# Seven faults, plus the cluster's start (the fixture counts).
@pytest.mark.timeout(900)
@pytest.mark.destructive(last=True)
def test_no_request_hangs_and_every_process_can_die_or_stall(two_of_each, model_dir):
    assert two_of_each.config().request_timeout_s == DEADLINE_S  # what the bench's deadlines assume
    lines = []
    outcomes = asyncio.run(chaos(two_of_each.url, model_dir.name, two_of_each.launcher.pid, SUITE_FAULTS,
                                 ChaosSpec(concurrency=4), lines.append))
    print("\n".join([HEADER, *lines]))
    problems = []
    for o in outcomes:
        target = o.scenario.split(" ", 1)[1]
        unexpected = set(o.errors) - EXPECTED_ERRORS[target]
        if o.hung or o.recovery_s is None or unexpected:
            problems.append(f"{row(o)}  (unexpected: {sorted(unexpected) or '-'})")
    assert not problems, "\n".join([HEADER, *problems])
    stalls, lost = conductor_stalls(two_of_each.run_dir / "conductor.log")
    assert stalls, "the Conductor's SIGSTOP was not noticed as a stall of its own loop"
    assert not lost, f"instances taken for lost as the stalled Conductor resumed: {lost}"


def conductor_stalls(log: Path, at_least_s: float = 0.6 * ChaosSpec().stall_s) -> tuple[list[datetime], list[str]]:
    """When the Conductor noticed its own loop had stalled as long as a SIGSTOP holds
    it, and any instance it called lost within 1.5 s of that (heartbeats queued while
    it was stopped are no silence)."""
    events = []
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
            events.append((datetime.fromisoformat(e["timestamp"]), e["event"], e.get("instance_id", ""),
                           e.get("stalled_ms", 0)))
        except (ValueError, KeyError):
            continue  # not one of its structured lines
    stalls = [t for t, event, _, ms in events if event.startswith("conductor loop stalled") and ms >= 1e3 * at_least_s]
    lost = [f"{who} at {t:%H:%M:%S.%f}" for t, event, who, _ in events if event == "instance lost"
            and any(0 <= (t - s).total_seconds() <= 1.5 for s in stalls)]
    return stalls, lost
