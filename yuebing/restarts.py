"""When the launcher starts a dead child again: at once the first time, then after a
delay that doubles with each death in a window; so many deaths in that window is a
crash loop, and the cluster stops instead of spinning. A child that fails the same
way several times in a row (the same exit code, the same last log line: a port
taken, a bad flag) will not start by waiting: it is given up. Pure: times and
failures in, delays and verdicts out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    window_s: float = 120.0  # deaths further back than this are forgiven
    crash_loop: int = 6  # this many deaths within the window: give up
    same_in_a_row: int = 3  # this many identical failures one after another: give up

    def delay(self, deaths: Sequence[float], now: float) -> float | None:
        """Seconds to wait before starting again a child that died at each time in
        `deaths` (the last one now); None when that is a crash loop."""
        recent = sum(1 for t in deaths if now - t <= self.window_s)
        if recent >= self.crash_loop:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, recent - 1))

    def gives_up(self, failures: Sequence[str]) -> bool:
        """Whether the last `same_in_a_row` failures (how each death read, oldest
        first; "" for a death by a signal, which says nothing of the child) are one."""
        last = failures[-self.same_in_a_row:]
        return len(last) == self.same_in_a_row and len(set(last)) == 1 and last[0] != ""
