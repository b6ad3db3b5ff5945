"""Asking a running cluster's services for their counters over NATS, as an operator would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import nats

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


def messenger(nats_url: str, node: str, corrupt_next: int | None = None, no_room_next: int = 0) -> MessengerStats:
    """A node messenger's counters (and, with `corrupt_next` or `no_room_next`, its
    fault switch), over NATS."""
    async def ask() -> MessengerStats:
        nc = await nats.connect(nats_url)
        try:
            cmd = (MessengerCommand(op="stats") if corrupt_next is None and not no_room_next
                   else MessengerCommand(op="fault", corrupt_next=corrupt_next or 0, no_room_next=no_room_next))
            msg = await nc.request(messenger_subject(node), encode(cmd), timeout=5)
            return decode(msg.data, MessengerStats)
        finally:
            await nc.close()

    return asyncio.run(ask())


def conductor_stats(nats_url: str) -> ConductorStats:
    async def ask() -> ConductorStats:
        nc = await nats.connect(nats_url)
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
