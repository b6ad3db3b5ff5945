"""Asking a running cluster's services for their counters over NATS, as an operator would."""

from __future__ import annotations

import asyncio

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
