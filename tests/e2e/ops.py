"""Asking a running cluster's services for their counters over NATS, as an operator
would: logged in as the cluster's admin identity."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
import nats
import psutil
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from shared import bus
from shared.identity import load_credentials
from shared.messages import (
    CONDUCTOR_STATS,
    HEARTBEAT,
    ConductorStats,
    Heartbeat,
    Message,
    MessengerCommand,
    MessengerStats,
    decode,
    encode,
    messenger_faults_subject,
    messenger_subject,
)

T = TypeVar("T")
M = TypeVar("M", bound=Message)


class Cluster(Protocol):
    nats_url: str
    admin_credentials: Path

    @property
    def api(self) -> str: ...


def cluster_over(launcher, folder: Path, transport: str) -> Iterator:  # -> Cluster
    """A 2-node cluster of its own moving KV over `transport`, fault injection on: for
    a module fixture that runs the KV-transfer tests again over another transport."""
    started = launcher(folder, "--nodes", "2", "--kv-transport", transport, "--fault-injection")
    try:
        yield started.wait()
    finally:
        started.stop()


def openai_client(cluster: Cluster):  # -> openai.OpenAI
    """The OpenAI client every e2e test talks to a cluster with (no retries: a test
    sees what the cluster answered)."""
    return client_at(cluster.api, getattr(cluster, "api_key", "") or "unused")  # an open cluster takes any key


def client_at(api: str, key: str = "unused"):  # -> openai.OpenAI
    """The same client for any OpenAI API's /v1 URL (plain `vllm serve`'s too)."""
    from openai import OpenAI

    return OpenAI(base_url=api, api_key=key, timeout=120, max_retries=0)


async def admin(cluster: Cluster) -> Client:
    return await bus.connect(cluster.nats_url, "tests", load_credentials(str(cluster.admin_credentials)))


def messenger(cluster: Cluster, node: str) -> MessengerStats:
    """A node messenger's counters, over NATS."""
    return asyncio.run(_ask(cluster, messenger_subject(node), MessengerCommand(op="stats")))


def arm_faults(cluster: Cluster, node: str, corrupt_next: int = 0, no_room_next: int = 0) -> MessengerStats:
    """A messenger's fault switch: on its own subject (the admin's only), obeyed because
    the test cluster's messengers run with --fault-injection."""
    cmd = MessengerCommand(op="fault", corrupt_next=corrupt_next, no_room_next=no_room_next)
    return asyncio.run(_ask(cluster, messenger_faults_subject(node), cmd))


async def _ask(cluster: Cluster, subject: str, cmd: MessengerCommand) -> MessengerStats:
    nc = await admin(cluster)
    try:
        return decode((await nc.request(subject, encode(cmd), timeout=5)).data, MessengerStats)
    finally:
        await nc.close()


def conductor_stats(cluster: Cluster) -> ConductorStats:
    async def ask() -> ConductorStats:
        nc = await admin(cluster)
        try:
            return decode((await nc.request(CONDUCTOR_STATS, b"{}", timeout=2)).data, ConductorStats)
        finally:
            await nc.close()

    return asyncio.run(ask())


async def collect(sub, kind: type[M], seconds: float, until: Callable[[M], bool] | None = None) -> list[M]:
    """The messages `sub` receives for `seconds`, decoded, in order; or up to the first
    one `until` accepts."""
    got: list[M] = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            got.append(decode((await sub.next_msg(timeout=left)).data, kind))
        except nats.errors.TimeoutError:
            break
        if until is not None and until(got[-1]):
            break
    return got


def every_conductor_stats(cluster: Cluster, seconds: float = 1.0) -> dict[str, ConductorStats]:
    """Each running Conductor's stats, by name: the stats subject is every Conductor's,
    so one ask gathers all their replies for `seconds`."""
    async def ask() -> dict[str, ConductorStats]:
        nc = await admin(cluster)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(CONDUCTOR_STATS, b"{}", reply=inbox)
            return {stats.conductor: stats for stats in await collect(sub, ConductorStats, seconds)}
        finally:
            await nc.close()

    return asyncio.run(ask())


def service(cluster, *words: str) -> psutil.Process | None:  # cluster: a launched one (tests/conftest.py)
    """The launcher's live child whose command line holds every word (pids change on restarts)."""
    for p in psutil.Process(cluster.launcher.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and all(w in p.cmdline() for w in words):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def beating(cluster: Cluster, instance_id: str, timeout_s: float = 120.0) -> int:
    """The instance's pid, once it beats (again, after a restart: its service up and
    its engine loaded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return latest_heartbeat(cluster, instance_id, seconds=1.0).pid
        except AssertionError:
            assert time.monotonic() < deadline, f"{instance_id} not beating within {timeout_s} s"


def latest_heartbeat(cluster: Cluster, instance_id: str, seconds: float = 1.5) -> Heartbeat:
    async def listen() -> Heartbeat:
        nc = await admin(cluster)
        heard = await collect(await nc.subscribe(HEARTBEAT), Heartbeat, seconds)
        await nc.close()
        found = [hb for hb in heard if hb.instance_id == instance_id]
        assert found, f"no heartbeat from {instance_id}"
        return found[-1]

    return asyncio.run(listen())


def eventually(probe: Callable[[], T], accept: Callable[[T], bool], what: str, timeout_s: float = 10.0) -> T:
    """Ask `probe` until `accept` says yes, or fail after `timeout_s`: counters fed by
    fire-and-forget messages (request updates, KV events) lag the response a client sees."""
    deadline = time.monotonic() + timeout_s
    while not accept(seen := probe()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s; last seen: {seen}"
        time.sleep(0.1)
    return seen


def log_events(cluster, name: str, event: str) -> list[dict]:
    """The records of `event` in process `name`'s JSON log, in order."""
    found = []
    for line in cluster.log(name).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def scrape(url: str) -> dict[str, float]:
    """Every sample on a Prometheus page, by name and labels."""
    text = httpx.get(url, timeout=5).text
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def collapsed(names: list[str]) -> list[str]:
    """Event names with each run of deltas as one: how many steps' tokens an engine
    hands over at once is timing, on vLLM's side as on ours."""
    return [n for i, n in enumerate(names) if not (i and n == names[i - 1] and n.endswith("delta"))]
