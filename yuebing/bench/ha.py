"""`yuebing bench ha`: the compose HA layout (compose/docker-compose.ha.yml) under steady
streaming load through its load balancer while, one step at a time:

- a server crashes: SIGKILL of a container's process (its restart policy brings it back,
  and the next step waits for it);
- a role is restarted one replica at a time (`docker compose restart`: SIGTERM, its
  grace, then a start), each back before the next;
- decode goes from two instances to one (`docker compose stop decode-1`).

Each step counts the requests that overlapped it: served whole, failed (an HTTP error,
an error event, or a stream cut short), and continued on another decode. A stream moved
off the stopped decode instance is compared with an uninterrupted run of its prompt.
For a crashed gateway it also says how long after the crash a new request still failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from yuebing import client
from yuebing.compose import COMPOSE_DIR, ComposeOptions, compose, gateway_sees, listed_instances, resolved, run

HA_FILES = (COMPOSE_DIR / "docker-compose.yml", COMPOSE_DIR / "docker-compose.ha.yml")
MODEL = "yuebing-tiny"
SETTLE_S = 8.0  # load runs on this long after each step's action, before the next
BACK_TIMEOUT_S = 300.0  # a restarted replica must be back within this (an engine loads its model)
LB_CHECK_S = 2.0  # HAProxy's checks: one a second, one passing to put a gateway back


@dataclass(frozen=True)
class Step:
    action: str  # "kill" (a crash), "restart" (one replica at a time) or "stop"
    services: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.action} {', '.join(self.services)}"


STEPS = (
    Step("kill", ("nats-1",)),
    Step("kill", ("conductor-1",)),
    Step("kill", ("gateway-1",)),
    Step("restart", ("nats", "nats-1", "nats-2")),
    Step("restart", ("conductor", "conductor-1")),
    Step("restart", ("gateway", "gateway-1")),
    Step("restart", ("messenger-0", "messenger-1")),
    Step("restart", ("prefill-0",)),
    Step("restart", ("decode-0", "decode-1")),
    Step("stop", ("decode-1",)),
)


@dataclass(frozen=True)
class Done:
    """One request as its client saw it (monotonic times)."""

    prompt: str
    sent: float
    ended: float
    ok: bool  # served whole: 200, no error event, every token asked for
    error: str
    token_ids: tuple[int, ...]
    migrations: int


@dataclass(frozen=True)
class Outcome:
    step: str
    requests: int
    failed: int
    continued: int  # streams continued on another decode instance
    errors: list[str]  # the first few failures' messages
    failing_for_s: float | None = None  # a crash: the last failing request sent after it, s after it
    unequal: int | None = None  # the stop: continued streams whose output differs from an uninterrupted run


@dataclass
class Load:
    """`clients` streaming back to back through the load balancer until stopped."""

    url: str
    api_key: str
    clients: int = 3
    max_tokens: int = 48
    done: list[Done] = field(default_factory=list)
    stopping: bool = False

    async def run(self) -> None:
        async with client.session(self.api_key, timeout_s=120, connections=self.clients) as s:
            await asyncio.gather(*(self._client(s, i) for i in range(self.clients)))

    async def _client(self, session, i: int) -> None:
        n = 0
        while not self.stopping:
            prompt = f"ha client {i} request {n}: the control plane keeps serving while servers come and go"
            self.done.append(await ask(session, self.url, prompt, self.max_tokens))
            n += 1
            if not self.done[-1].ok:
                await asyncio.sleep(0.2)  # a failing cluster is not hammered in a tight loop


async def ask(session, url: str, prompt: str, max_tokens: int) -> Done:
    result = await client.stream(session, url, client.completion_body(MODEL, prompt, max_tokens))
    whole = result.ok and len(result.token_ids) == max_tokens
    error = result.error or ("" if whole else f"stream cut short at {len(result.token_ids)} of {max_tokens} tokens")
    return Done(prompt, result.sent_at, time.monotonic(), whole, error[:200], tuple(result.token_ids),
                int((result.yuebing or {}).get("migrations") or 0))


def crash(options: ComposeOptions, service: str) -> None:
    """SIGKILL the container's main process: a crash, which its restart policy answers
    (a `docker kill` would count as stopped by hand)."""
    pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", f"{options.project}-{service}-1"]).stdout.strip()
    os.kill(int(pid), signal.SIGKILL)


def healthy_now(container: str) -> bool | None:
    """The container's own health check, run now (None: it has none). Docker's status
    lags a restart by its interval, and may still say healthy from before it."""
    check = json.loads(run(["docker", "inspect", "-f", "{{json .Config.Healthcheck}}", container]).stdout or "null")
    test = (check or {}).get("Test") or []
    if not test or test[0] not in ("CMD", "CMD-SHELL"):
        return None
    argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
    return run(["docker", "exec", container, *argv], timeout_s=30, check=False).returncode == 0


def wait_back(options: ComposeOptions, service: str, since: float) -> None:
    """Until a replica restarted (or crashed) serves again: listed alive by the gateways
    where it is an instance, its health check passing where it has one (and HAProxy's
    next check after it), else a few seconds."""
    container = f"{options.project}-{service}-1"
    instances = listed_instances(resolved(options))  # each engine's and messenger's --instance-id: its service's name
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        if service in instances:  # listed by the gateways' /health when alive
            if service in (gateway_sees(options.url) or set()):
                return
        elif (healthy := healthy_now(container)) is not None:
            if healthy:
                time.sleep(LB_CHECK_S)
                return
        elif time.monotonic() - since > 3:
            return
        time.sleep(1)
    raise RuntimeError(f"{service} not back within {BACK_TIMEOUT_S:.0f} s")


def act(options: ComposeOptions, env: dict[str, str], step: Step, say: Callable[[str], None]) -> None:
    for service in step.services:
        started = time.monotonic()
        if step.action == "kill":
            crash(options, service)
            time.sleep(1)  # dead before it is asked whether it is back
            wait_back(options, service, started)
        elif step.action == "restart":
            compose(options, "restart", service, env=env, timeout_s=180)
            wait_back(options, service, started)
        else:
            compose(options, "stop", service, env=env, timeout_s=180)
        say(f"  {step.action} {service}: {time.monotonic() - started:.1f} s")


def outcome(step: Step, done: list[Done], start: float, end: float) -> Outcome:
    seen = [d for d in done if d.ended >= start and d.sent <= end]
    failed = [d for d in seen if not d.ok]
    late = [d.sent - start for d in failed if d.sent >= start]
    return Outcome(step.name, len(seen), len(failed), sum(1 for d in seen if d.migrations),
                   [d.error for d in failed[:3]], max(late) if step.action == "kill" and late else None)


async def drill(options: ComposeOptions, env: dict[str, str], steps: tuple[Step, ...], clients: int,
                say: Callable[[str], None]) -> list[Outcome]:
    load = Load(options.url, options.api_key_file.read_text().strip(), clients)
    running = asyncio.create_task(load.run())
    await asyncio.sleep(SETTLE_S)
    outcomes = []
    for step in steps:
        start = time.monotonic()
        say(f"{step.name}")
        await asyncio.to_thread(act, options, env, step, say)
        await asyncio.sleep(SETTLE_S)
        outcomes.append(outcome(step, load.done, start, time.monotonic()))
        say(row(outcomes[-1]))
    load.stopping = True
    await running
    return await _compared(load, outcomes, steps)


async def _compared(load: Load, outcomes: list[Outcome], steps: tuple[Step, ...]) -> list[Outcome]:
    """The stop's continued streams against an uninterrupted run of each prompt (on the
    decode instance left)."""
    if not steps or steps[-1].action != "stop":
        return outcomes
    last = outcomes[-1]
    moved = [d for d in load.done if d.migrations and d.ok]
    async with client.session(load.api_key, timeout_s=120, connections=1) as s:
        again = [await ask(s, load.url, d.prompt, load.max_tokens) for d in moved]
    unequal = sum(1 for d, a in zip(moved, again, strict=True) if d.token_ids != a.token_ids)
    outcomes[-1] = Outcome(last.step, last.requests, last.failed, last.continued, last.errors, last.failing_for_s,
                           unequal)
    return outcomes


HEADER = f"{'step':<42} {'requests':>8} {'failed':>6} {'continued':>9}  notes"


def row(o: Outcome) -> str:
    notes = []
    if o.failing_for_s is not None:
        notes.append(f"new requests failed until {o.failing_for_s:.1f} s after")
    if o.unequal is not None:
        notes.append(f"{o.unequal} continued streams unequal to an uninterrupted run")
    if o.errors:
        notes.append("; ".join(o.errors))
    return f"{o.step:<42} {o.requests:>8} {o.failed:>6} {o.continued:>9}  {' | '.join(notes)}"


def options_for(work: Path, api_port: int, say: Callable[[str], None]) -> ComposeOptions:
    return ComposeOptions(files=HA_FILES, project="yuebing-ha", secrets=work / "secrets", api_port=api_port,
                          config=COMPOSE_DIR / "cluster.ha.json", say=say)
