"""Who is alive, from heartbeats: the Conductor schedules on it, the gateway uses it
to fail a stream fast when the instance serving it stops beating."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Heartbeat, Role


@dataclass
class Registry:
    timeout_s: float
    latest: dict[str, Heartbeat] = field(default_factory=dict)
    seen_at: dict[str, float] = field(default_factory=dict)

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the instance is new, back from the dead, or
        restarted within the timeout (a new pid: whatever the old process held is gone)."""
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

    def expire(self, now: float) -> list[str]:
        """Forget instances that stopped beating; returns their ids."""
        gone = [iid for iid in self.latest if not self.is_alive(iid, now)]
        for iid in gone:
            del self.latest[iid]
            del self.seen_at[iid]
        return gone
