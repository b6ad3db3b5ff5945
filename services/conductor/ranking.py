"""Instances in order of a key the books keep current, so that a decision reads the
few least loaded without looking at every instance.

A sorted list of (key, instance): an update is a binary search and a memmove (a
thousand entries move in about a microsecond), a read walks from the front and
stops after `k`. The Conductor keeps one per role (state.py): prefill instances by
when their queue empties, decode instances by their booked batch's step time.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator


class Ranking:
    def __init__(self) -> None:
        self._keys: dict[str, float] = {}
        self._order: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._keys

    def __iter__(self) -> Iterator[str]:
        return (iid for _, iid in self._order)

    def key(self, instance_id: str) -> float:
        return self._keys[instance_id]

    def set(self, instance_id: str, key: float) -> None:
        """Put the instance at `key` (added if new)."""
        old = self._keys.get(instance_id)
        if old == key:
            return
        if old is not None:
            self._drop(old, instance_id)
        self._keys[instance_id] = key
        insort(self._order, (key, instance_id))

    def remove(self, instance_id: str) -> None:
        old = self._keys.pop(instance_id, None)
        if old is not None:
            self._drop(old, instance_id)

    def first(self, k: int, skip: Callable[[str], bool] | None = None) -> list[str]:
        """The `k` lowest-keyed instances (ties by id) that `skip` does not reject."""
        out: list[str] = []
        for _, iid in self._order:
            if len(out) == k:
                break
            if skip is None or not skip(iid):
                out.append(iid)
        return out

    def _drop(self, key: float, instance_id: str) -> None:
        i = bisect_left(self._order, (key, instance_id))
        del self._order[i]
