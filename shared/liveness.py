"""Who is alive, from heartbeats: the Conductor schedules on it, the gateway uses it
to fail a stream fast when the instance serving it stops beating.

Bounded: an instance silent for `forget_s` is removed, not just shown dead, by
`observe` itself (every `forget_s / 4` at most), so a registry that nobody calls
`expire` on (the gateway's) does not keep every instance that ever beat. The clock
is always passed in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

FORGET_S = 300.0  # an instance silent this long is forgotten altogether

from shared.messages import Heartbeat, Role


@dataclass
class Registry:
    timeout_s: float
    latest: dict[str, Heartbeat] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)
    forget_s: float = FORGET_S
    pruned_at: float | None = None  # when observe last forgot the long silent
    deafness: Deafness | None = None  # with one, `heard` discounts this process's own stalls

    def __post_init__(self) -> None:
        # Forgetting one still within the timeout would make it look new.
        self.forget_s = max(self.forget_s, self.timeout_s)

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the instance is new, back from the dead, or
        restarted within the timeout (a new pid: whatever the old process held is gone)."""
        self._prune(now)
        old = self.latest.get(hb.instance_id)
        fresh = not self.is_alive(hb.instance_id, now) or (old is not None and old.pid != hb.pid)
        self.latest[hb.instance_id] = hb
        self.seen_at[hb.instance_id] = now
        return fresh

    def is_alive(self, instance_id: str, now: float) -> bool:
        seen = self.seen_at.get(instance_id)
        return seen is not None and now - seen <= self.timeout_s

    def alive(self, role: Role, now: float) -> list[Heartbeat]:
        """Live instances of a role, in a stable order (by id)."""
        return sorted(
            (hb for iid, hb in self.latest.items() if hb.role == role and self.is_alive(iid, now)),
            key=lambda hb: hb.instance_id,
        )

    def heard(self, now: float) -> float:
        """This process is listening now (its handlers say so before they judge, and a
        ticker between messages): the stall since it last was, if any, is no
        instance's silence. Returns that stall, s (0: none)."""
        deaf_s = self.deafness.since_last(now) if self.deafness is not None else 0.0
        if deaf_s:
            self.unheard(deaf_s, now)
        return deaf_s

    def unheard(self, deaf_s: float, now: float) -> None:
        """This process could not listen for `deaf_s` (see Deafness): that time is no
        instance's silence, so each last beat counts as that much later."""
        shift_seen(self.seen_at, deaf_s, now)

    def expire(self, now: float) -> list[str]:
        """Forget instances that stopped beating; returns their ids."""
        return self._forget_silent(now, self.timeout_s)

    def _prune(self, now: float) -> None:
        if self.pruned_at is None or now - self.pruned_at >= self.forget_s / 4:
            self.pruned_at = now
            self._forget_silent(now, self.forget_s)

    def _forget_silent(self, now: float, after_s: float) -> list[str]:
        gone = [iid for iid, seen in self.seen_at.items() if now - seen > after_s]
        for iid in gone:
            del self.latest[iid]
            del self.seen_at[iid]
        return gone


def shift_seen(seen_at: dict[str, float], deaf_s: float, now: float) -> None:
    """Each last-heard time in `seen_at` counted `deaf_s` later (never past `now`):
    this process could not listen that long, so it is nobody's silence."""
    for key, seen in seen_at.items():
        seen_at[key] = min(now, seen + deaf_s)


def woke_late(since: float, asked_s: float, grace_s: float, now: float | None = None) -> bool:
    """Whether a wait that began at `since` (monotonic) and asked for `asked_s` ended
    more than `grace_s` late: this process's event loop stalled (measured: 2.5 s on a
    busy 2-core host), and the messages that came meanwhile are still unread. A
    watcher that judges silence then would take a live instance for dead, so it
    judges on its next wake instead (the gateway's), or counts the stall as nobody's
    silence (the Conductor's, through Deafness)."""
    return (time.monotonic() if now is None else now) - since > asked_s + grace_s


@dataclass
class Deafness:
    """How long this process could not listen, for a Registry judged inside message
    handlers rather than by a watcher: the first handler after a stall would find
    every instance silent for as long, and drop live ones whose heartbeats wait
    unread. `since_last(now)`, called by each turn that reads a message and by a
    ticker every `tick_s` between them, says how much of the time since the call
    before was a stall: the gap beyond a tick, when it is over `grace_s`."""

    tick_s: float
    grace_s: float
    last: float | None = None

    def since_last(self, now: float) -> float:
        last = self.last
        self.last = now if last is None else max(last, now)
        if last is None or not woke_late(last, self.tick_s, self.grace_s, now):
            return 0.0
        return now - last - self.tick_s
