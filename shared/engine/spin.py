"""A vLLM "general plugin" that caps the busy-wait of vLLM's inter-process queues,
so that several engines can share a small machine's cores."""

from __future__ import annotations

import os

SPIN_ENV = "YUEBING_ENGINE_SPIN_S"
IDLE_POLL_MS = 2  # how often a sleeping vLLM queue reader rechecks (limit_idle_spin)


def limit_idle_spin() -> None:
    """vLLM's engine and worker processes hand each other work through shared-memory
    queues whose readers busy-wait (sched_yield) for a hard-coded 1 s after every
    message. Where engines share cores that steals the CPU from whichever engine has
    work: with three engines on two cores, idle workers took 30-95 % of a core each
    and a 2,048-token prefill took up to 1 s instead of 140 ms. A short spin keeps
    back-to-back steps fast and lets idle engines sleep.

    A sleeping reader then relies on a ZeroMQ notification that vLLM sends through a
    PUB socket with a high-water mark of 1, and some are dropped: the reader slept
    until its 5 s recheck (measured: a 5,010 ms gap in a decode stream, right as
    another request finished). Under the stock 1 s spin that drop almost never
    matters; under a short spin it would happen on every idle gap, so a sleeping
    reader also rechecks the queue every IDLE_POLL_MS.

    vLLM spawns its processes, so this runs in each of them: it is a vLLM "general
    plugin" (pyproject.toml), which vLLM loads in its engine and worker processes,
    and it takes the limit from the environment they inherit (engine_environment).
    Any vLLM started from this environment gets it, the baselines the benchmarks
    compare against included, so comparisons are engine against the same engine."""
    value = os.environ.get(SPIN_ENV)
    if value is None:
        return
    seconds = float(value)
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition.wait, "yuebing_limit", None) == seconds:
        return
    original = getattr(condition.wait, "__wrapped__", condition.wait)

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, seconds)
        original(self, IDLE_POLL_MS if timeout_ms is None else min(timeout_ms, IDLE_POLL_MS))

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    wait.yuebing_limit = seconds  # type: ignore[attr-defined]
    condition.wait = wait
