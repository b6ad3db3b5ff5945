"""`yuebing bench soak`: three times the measured capacity for minutes, on a live
cluster, and whether it holds.

One `yuebing up` cluster with its default admission (predictive, SLOs from the
profile). First its capacity: `concurrency` clients back to back give the rate it
serves when saturated. Then the same short requests arrive as a Poisson stream at
that rate (`at capacity`), then at `overload` times it for `minutes`. For each run:
requests, served, rejected (429), other errors, timeouts, the share of served
requests that met both SLOs (TTFT, and mean time between tokens); during the
overload, the gateway's and the Conductor's resident memory at its start and end,
and whether any process died (the launcher's log says so).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from yuebing import client
from yuebing.bench.chaos import find, kind_of


@dataclass(frozen=True)
class SoakSpec:
    overload: float = 3.0  # times the measured capacity
    minutes: float = 5.0
    capacity_s: float = 60.0  # how long each of the two capacity runs lasts
    concurrency: int = 8  # clients that saturate the cluster when measuring its capacity
    prompt_chars: int = 600
    max_tokens: int = 32


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tbt_s: float


@dataclass(frozen=True)
class Served:
    kind: str  # "ok", an HTTP status, "stream" or "connection" (chaos.kind_of)
    met_ttft: bool
    met_tbt: bool

    @property
    def met_slo(self) -> bool:
        return self.met_ttft and self.met_tbt


@dataclass(frozen=True)
class RunResult:
    name: str
    rate: float  # offered, requests/s
    requests: int
    kinds: dict[str, int]
    slo_met: float  # share of the served (ok) requests that met both SLOs
    timeouts: int  # 504s and requests the client gave up on
    ttft_met: float = 0.0  # the same share for each SLO alone
    tbt_met: float = 0.0


@dataclass
class Memory:
    """Resident memory of a process, MiB, sampled through a run."""

    samples: list[float] = field(default_factory=list)

    def sample(self, proc: psutil.Process) -> None:
        self.samples.append(proc.memory_info().rss / (1 << 20))


def met(result: client.Streamed, slo: Slo) -> tuple[bool, bool]:
    """Whether a request met its TTFT SLO, and its TBT SLO (mean time between tokens)."""
    if not result.ok or result.ttft_s is None:
        return False, False
    times = result.token_times
    tbt = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return result.ttft_s <= slo.ttft_s, tbt <= slo.tbt_s


def summarize(name: str, rate: float, served: list[Served]) -> RunResult:
    kinds = Counter(s.kind for s in served)
    ok = [s for s in served if s.kind == "ok"]

    def share(of) -> float:
        return sum(of(s) for s in ok) / len(ok) if ok else 0.0

    return RunResult(name, rate, len(served), dict(kinds), share(lambda s: s.met_slo),
                     kinds.get("504", 0) + kinds.get("connection", 0),
                     share(lambda s: s.met_ttft), share(lambda s: s.met_tbt))


class Driver:
    """Sends the bench's requests and judges them against the cluster's SLOs."""

    def __init__(self, url: str, model: str, slo: Slo, spec: SoakSpec, timeout_s: float) -> None:
        self.url, self.model, self.slo, self.spec, self.timeout_s = url, model, slo, spec, timeout_s
        self.rnd = random.Random(11)

    def body(self) -> dict:
        words = " ".join(str(self.rnd.randrange(10_000)) for _ in range(self.spec.prompt_chars // 5))
        return client.completion_body(self.model, words, self.spec.max_tokens)

    async def one(self, session) -> Served:
        result = await client.stream(session, self.url, self.body())
        return Served(kind_of(result), *met(result, self.slo))

    async def saturate(self, seconds: float) -> float:
        """Requests/s that `concurrency` clients back to back get served."""
        done: list[Served] = []
        end = time.monotonic() + seconds

        async def loop(session) -> None:
            while time.monotonic() < end:
                done.append(await self.one(session))

        async with client.session(timeout_s=self.timeout_s, connections=self.spec.concurrency) as s:
            await asyncio.gather(*(loop(s) for _ in range(self.spec.concurrency)))
        return sum(d.kind == "ok" for d in done) / seconds

    async def poisson(self, rate: float, seconds: float, tick=None) -> list[Served]:
        """Open-loop arrivals at `rate`/s for `seconds`; `tick()` every ~10 s."""
        tasks: list[asyncio.Task[Served]] = []
        start = time.monotonic()
        next_tick = start
        async with client.session(timeout_s=self.timeout_s, connections=10_000) as s:
            at = start
            while (at := at + self.rnd.expovariate(rate)) < start + seconds:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(self.one(s)))
                if tick is not None and time.monotonic() >= next_tick:
                    tick()
                    next_tick += 10.0
            return list(await asyncio.gather(*tasks))


def deaths(launcher_log: Path) -> int:
    """Children the launcher reported dead (its "<name> (pid N) exited/killed" lines)."""
    return len(re.findall(r"\(pid \d+\) (exited|killed)", launcher_log.read_text(errors="replace")))


async def soak(driver: Driver, launcher_pid: int, say) -> dict:
    spec = driver.spec
    capacity = await driver.saturate(spec.capacity_s)
    say(f"capacity: {capacity:.2f} requests/s served by {spec.concurrency} clients back to back")
    at_capacity = summarize("at capacity", capacity, await driver.poisson(capacity, spec.capacity_s))
    say(line(at_capacity))
    memory = {name: Memory() for name in ("gateway", "conductor")}
    procs = {name: find(launcher_pid, name) for name in memory}

    def tick() -> None:
        for name, m in memory.items():
            m.sample(procs[name])

    rate = spec.overload * capacity
    overload = summarize(f"{spec.overload:g}x capacity", rate, await driver.poisson(rate, spec.minutes * 60, tick))
    tick()
    say(line(overload))
    for name, m in memory.items():
        say(f"{name} memory: {m.samples[0]:.0f} MiB at the start, {m.samples[-1]:.0f} MiB at the end "
            f"(median {statistics.median(m.samples):.0f})")
    return {"capacity_rps": capacity, "runs": [at_capacity, overload],
            "memory_mib": {k: v.samples for k, v in memory.items()}}


def line(r: RunResult) -> str:
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r.kinds.items()))
    return (f"{r.name:<16} {r.rate:6.2f}/s offered  {r.requests:5d} requests  ({kinds})  "
            f"timeouts {r.timeouts}  SLOs met by {r.slo_met:.0%} of those served "
            f"(TTFT {r.ttft_met:.0%}, TBT {r.tbt_met:.0%})")
