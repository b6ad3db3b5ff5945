"""`yuebing bench chaos`: kill or stall each process of a live cluster under steady
streaming load, and see what clients see.

One `yuebing up --nodes 2` cluster; `concurrency` clients stream short greedy
completions back to back, easing off (EASED_PAUSE_S) while a restarted process comes
back. Each scenario waits until requests succeed,
then SIGKILLs a process (the launcher starts it again) or SIGSTOPs it for longer than
the liveness timeout and SIGCONTs it, and watches until a request sent after the
fault has succeeded (a probe sends requests of its own until one does: the load's
clients may all be held by requests the fault broke) and the process is back. For
each: the requests that were in flight or sent meanwhile,
their errors by kind (HTTP status, or a stream or connection error), how many ran
past their deadline ("hung": must be none), and the seconds from the fault until a
request succeeded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from yuebing import client

TARGETS = ("gateway", "conductor", "messenger-0", "messenger-1", "prefill-0", "decode-0",
           "engine:prefill-0", "engine:decode-0", "nats")
ACTIONS = ("kill", "stop")
# What clients may see while each process is down or stalled (docs/reliability.md says why):
# error kinds as `kind_of` names them. Anything else is a bug.
EXPECTED_ERRORS: dict[str, set[str]] = {
    "gateway": {"connection", "stream"},  # the front door itself: clients retry, or another gateway serves
    "conductor": {"503"},  # a stalled one: its schedule timeout; a restart: a request or two at most
    "nats": {"503", "504", "stream"},  # streams in flight lose chunks (504: the token idle timeout)
    # Everything else is retried, or continued on another instance, within the deadline.
    "messenger-0": set(),
    "messenger-1": set(),
    "prefill-0": set(),
    "decode-0": set(),
    "engine:prefill-0": set(),
    "engine:decode-0": set(),
}
DEADLINE_S = 30.0  # the cluster's request timeout in this bench (`--request-timeout`)
# Between a client's requests while the load eases (a restarted process coming back):
# back to back, the load alone keeps a small host busy, and a restarting engine (three
# processes, each importing torch and vLLM) then took over 4 min on 2 cores instead of 1.
EASED_PAUSE_S = 2.0
HUNG_GRACE_S = 5.0  # beyond its deadline, a request that has not ended is hung


@dataclass(frozen=True)
class Fault:
    target: str  # a child of the launcher by name, or "engine:<instance>" for its vLLM engine-core
    action: str  # "kill" (SIGKILL) or "stop" (SIGSTOP for stall_s, then SIGCONT)

    @property
    def name(self) -> str:
        return f"{self.action} {self.target}"


def scenarios(targets: tuple[str, ...] = TARGETS, actions: tuple[str, ...] = ACTIONS) -> list[Fault]:
    return [Fault(t, a) for t in targets for a in actions]


@dataclass(frozen=True)
class Done:
    """One request as the client saw it; times are monotonic."""

    sent: float
    ended: float
    kind: str  # "ok", an HTTP status ("503"), "stream" (an error after the stream began) or "connection"


@dataclass(frozen=True)
class Outcome:
    scenario: str
    requests: int
    errors: dict[str, int]
    hung: int
    recovery_s: float | None  # None: no request succeeded again within the window


def kind_of(result: client.Streamed) -> str:
    if result.ok:
        return "ok"
    if result.status == 200:
        return "stream"
    return str(result.status) if result.status else "connection"


def outcome(fault: Fault, done: list[Done], fault_at: float, cleared_at: float, until: float) -> Outcome:
    """The requests that overlapped [fault_at, until]. Recovery: 0 when nothing failed,
    else from the fault to the first success of a request sent once it had cleared
    (requests in flight at the fault may still fail after that: they count as errors)."""
    seen = [d for d in done if d.ended >= fault_at and d.sent <= until]
    errors = Counter(d.kind for d in seen if d.kind != "ok")
    hung = sum(1 for d in seen if d.ended - d.sent > DEADLINE_S + HUNG_GRACE_S)
    return Outcome(fault.name, len(seen), dict(errors), hung, _recovery(seen, fault_at, cleared_at))


def _recovery(seen: list[Done], fault_at: float, cleared_at: float) -> float | None:
    if all(d.kind == "ok" for d in seen):
        return 0.0
    back = [d.ended for d in seen if d.kind == "ok" and d.sent >= cleared_at]
    return min(back) - fault_at if back else None


@dataclass
class Load:
    """`concurrency` clients streaming back to back until stopped; while `full` is
    clear (eased), each waits EASED_PAUSE_S between requests."""

    url: str
    model: str
    concurrency: int = 4
    max_tokens: int = 24
    done: list[Done] = field(default_factory=list)
    sending: dict[int, float] = field(default_factory=dict)  # client → when its request in flight was sent
    stopping: bool = False
    full: asyncio.Event = field(default_factory=asyncio.Event)  # clear: eased
    cleared_at: float | None = None  # the current fault's end, once it has ended

    async def run(self) -> None:
        async with client.session(timeout_s=DEADLINE_S + 2 * HUNG_GRACE_S, connections=self.concurrency) as s:
            await asyncio.gather(*(self._client(s, i) for i in range(self.concurrency)))

    async def _client(self, session, i: int) -> None:
        n = 0
        while not self.stopping:
            body = client.completion_body(self.model, f"chaos client {i} request {n}: tell me more", self.max_tokens)
            self.sending[i] = time.monotonic()
            result = await client.stream(session, self.url, body)
            del self.sending[i]
            self.done.append(Done(result.sent_at, time.monotonic(), kind_of(result)))
            n += 1
            if not self.full.is_set():
                await self._eased_pause()
            elif not result.ok:
                await asyncio.sleep(0.2)  # a failing cluster is not hammered in a tight loop

    async def _eased_pause(self) -> None:
        """EASED_PAUSE_S, cut short when the full load resumes (a fault is coming)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.full.wait(), EASED_PAUSE_S)

    def succeeded_since(self, t: float) -> bool:
        return any(d.kind == "ok" and d.sent >= t for d in self.done)

    async def probe_until_served(self, since: float, window_s: float) -> None:
        """Send short requests of its own, one at a time, until one sent after the fault
        cleared succeeds: the load's clients may all be held by requests the fault
        broke, and sending nothing new they would not see the cluster come back."""
        deadline = since + window_s
        async with client.session(timeout_s=10.0, connections=1) as s:
            while time.monotonic() < deadline:
                result = await client.stream(s, self.url, client.completion_body(self.model, "probe", 2))
                self.done.append(Done(result.sent_at, time.monotonic(), kind_of(result)))
                if result.ok and self.cleared_at is not None and result.sent_at >= self.cleared_at:
                    return
                await asyncio.sleep(0.2)

    def all_ended_sent_before(self, t: float) -> bool:
        return all(sent > t for sent in self.sending.values())


def find(launcher_pid: int, target: str) -> psutil.Process:
    """The launcher's live child for `target` (pids change as children restart)."""
    service, _, instance = target.partition(":")
    name = instance or service
    for child in psutil.Process(launcher_pid).children():
        try:
            argv = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        if _is(argv, name):
            return _engine_core(child) if instance else child
    raise LookupError(f"no live process for {target}")


def _is(argv: list[str], name: str) -> bool:
    if name == "nats":
        return bool(argv) and Path(argv[0]).name == "nats-server"
    if name in ("gateway", "conductor"):
        return f"services.{name}" in argv
    return "--instance-id" in argv and argv[argv.index("--instance-id") + 1] == name


def _engine_core(service: psutil.Process) -> psutil.Process:
    for p in service.children(recursive=True):
        if "EngineCore" in p.name() + " ".join(p.cmdline()):
            return p
    raise LookupError(f"no engine-core under pid {service.pid}")


async def wait_until(check: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


async def inject(launcher_pid: int, fault: Fault, stall_s: float) -> float:
    """Apply `fault`; returns when it has cleared (at once for a kill)."""
    proc = find(launcher_pid, fault.target)
    if fault.action == "kill":
        os.kill(proc.pid, signal.SIGKILL)
        return time.monotonic()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(stall_s)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return time.monotonic()


async def instances(url: str) -> set[str]:
    """The instances the gateway sees alive (its /health)."""
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return set()
    return {i for ids in (body.get("instances") or {}).values() for i in ids}


# Longer than the liveness timeout: an instance about to drop out (killed, its silence
# not yet noticed) has dropped out by then.
SETTLED_S = 3.0


async def whole(url: str, everyone: set[str], deadline: float) -> bool:
    """Every instance seen alive for SETTLED_S without a break, by `deadline`: a killed
    one noticed lost, restarted and back."""
    whole_since: float | None = None
    while whole_since is None or time.monotonic() - whole_since < SETTLED_S:
        if time.monotonic() > deadline:
            return False
        alive = everyone <= await instances(url)
        whole_since = (whole_since or time.monotonic()) if alive else None
        await asyncio.sleep(0.5)
    return True


async def settle(load: Load, everyone: set[str], window_s: float) -> bool:
    """The cluster whole (the last scenario's restarts done, engines up), and a request served."""
    deadline = time.monotonic() + window_s
    if not await whole(load.url, everyone, deadline):
        return False
    settled = time.monotonic()
    return await wait_until(lambda: load.succeeded_since(settled), max(1.0, deadline - settled))


async def run_scenario(load: Load, launcher_pid: int, fault: Fault, stall_s: float, window_s: float,
                       everyone: set[str]) -> Outcome:
    """Steady state first (everyone alive, a request sent now succeeds), then the fault
    under full load, then watch. The load eases while restarts finish (EASED_PAUSE_S)."""
    load.full.clear()
    if not await settle(load, everyone, window_s):
        raise RuntimeError(f"the cluster was not whole and serving before {fault.name}")
    load.full.set()
    await asyncio.sleep(1.0)  # a second of steady load in flight
    fault_at = time.monotonic()
    load.cleared_at = None
    probing = asyncio.create_task(load.probe_until_served(fault_at, window_s), name="chaos probe")
    cleared_at = await inject(launcher_pid, fault, stall_s)
    load.cleared_at = cleared_at
    await probing
    # The whole outage is judged, not just until the first success: every request sent
    # until the faulted process is back (a restart takes tens of seconds).
    load.full.clear()
    await whole(load.url, everyone, time.monotonic() + window_s)
    # Requests sent before recovery are judged too: wait for those in flight to end
    # (the clients give up on a request well after it should have, so this is bounded).
    until = time.monotonic()
    await wait_until(lambda: load.all_ended_sent_before(until), DEADLINE_S + 3 * HUNG_GRACE_S)
    return outcome(fault, load.done, fault_at, cleared_at, until)


async def chaos(url: str, model: str, launcher_pid: int, faults: list[Fault], spec: ChaosSpec,
                say: Callable[[str], None]) -> list[Outcome]:
    """Every fault in turn, under one steady load."""
    load = Load(url, model, spec.concurrency)
    runner = asyncio.create_task(load.run(), name="chaos load")
    everyone = await instances(url)
    outcomes = []
    try:
        for fault in faults:
            result = await run_scenario(load, launcher_pid, fault, spec.stall_s, spec.window_s, everyone)
            say(row(result))
            outcomes.append(result)
    finally:
        load.stopping = True
        await asyncio.wait_for(runner, DEADLINE_S + 3 * HUNG_GRACE_S)
    return outcomes


@dataclass(frozen=True)
class ChaosSpec:
    concurrency: int = 4
    stall_s: float = 5.0  # longer than the liveness timeout (2 s by default)
    window_s: float = 240.0  # the longest wait for requests to succeed again (an engine restarts in ~40 s)


HEADER = f"{'scenario':<24} {'requests':>8} {'hung':>5} {'recovery s':>10}  errors"


def row(o: Outcome) -> str:
    recovery = f"{o.recovery_s:.1f}" if o.recovery_s is not None else "never"
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(o.errors.items())) or "-"
    return f"{o.scenario:<24} {o.requests:>8} {o.hung:>5} {recovery:>10}  {errors}"
