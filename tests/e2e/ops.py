"""Asking a running cluster's services for their counters over NATS, as an operator
would: logged in as the cluster's admin identity."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from nats.aio.client import Client

from shared import bus
from shared.identity import load_credentials
from shared.messages import (
    CONDUCTOR_STATS,
    ConductorStats,
    MessengerCommand,
    MessengerStats,
    decode,
    encode,
    messenger_subject,
)

T = TypeVar("T")


class Cluster(Protocol):
    nats_url: str
    admin_credentials: Path


async def admin(cluster: Cluster) -> Client:
    return await bus.connect(cluster.nats_url, "tests", load_credentials(str(cluster.admin_credentials)))


def messenger(cluster: Cluster, node: str, corrupt_next: int | None = None, no_room_next: int = 0) -> MessengerStats:
    """A node messenger's counters (and, with `corrupt_next` or `no_room_next`, its
    fault switch), over NATS."""
    async def ask() -> MessengerStats:
        nc = await admin(cluster)
        try:
            cmd = (MessengerCommand(op="stats") if corrupt_next is None and not no_room_next
                   else MessengerCommand(op="fault", corrupt_next=corrupt_next or 0, no_room_next=no_room_next))
            msg = await nc.request(messenger_subject(node), encode(cmd), timeout=5)
            return decode(msg.data, MessengerStats)
        finally:
            await nc.close()

    return asyncio.run(ask())


def conductor_stats(cluster: Cluster) -> ConductorStats:
    async def ask() -> ConductorStats:
        nc = await admin(cluster)
        try:
            return decode((await nc.request(CONDUCTOR_STATS, b"{}", timeout=2)).data, ConductorStats)
        finally:
            await nc.close()

    return asyncio.run(ask())


def eventually(probe: Callable[[], T], accept: Callable[[T], bool], what: str, timeout_s: float = 10.0) -> T:
    """Ask `probe` until `accept` says yes, or fail after `timeout_s`: counters fed by
    fire-and-forget messages (request updates, KV events) lag the response a client sees."""
    deadline = time.monotonic() + timeout_s
    while not accept(seen := probe()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s; last seen: {seen}"
        time.sleep(0.1)
    return seen
