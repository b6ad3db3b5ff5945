"""Stop strings found in a growing text in linear time: one Knuth–Morris–Pratt
automaton per stop string, fed each new character once.

Each automaton's state is the longest prefix of its stop string that the text ends
with, which is both how a match is found and how much text must be held back
because it could still become a stop string (the old scan recomputed that from
scratch on every token: quadratic in the stop strings' length)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _failure(s: str) -> list[int]:
    """fail[k]: the longest proper border of s[:k+1]."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


@dataclass(frozen=True)
class Match:
    start: int  # where the stop string begins in the whole text
    length: int


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._fed = 0  # characters of the text seen so far

    def feed(self, text: str) -> Match | None:
        """Feed the text's next characters; the earliest-starting stop string that
        completes in them (a matcher is done after a match)."""
        found: Match | None = None
        for j, stop in enumerate(self.stops):
            end = self._advance(j, stop, text)
            start = self._fed + end + 1 - len(stop)
            if end >= 0 and (found is None or start < found.start):
                found = Match(start, len(stop))
        self._fed += len(text)
        return found

    def _advance(self, j: int, stop: str, text: str) -> int:
        """Run stop j's automaton over text; the index in text where it completes, or -1."""
        k, fail = self._state[j], self._fail[j]
        for i, c in enumerate(text):
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
            if k == len(stop):
                self._state[j] = k
                return i
        self._state[j] = k
        return -1

    def pending(self) -> int:
        """How many trailing characters could still begin a stop string."""
        return max(self._state, default=0)
