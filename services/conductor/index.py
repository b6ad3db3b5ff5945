"""Which instance holds which KV blocks: block hash → holders, per-instance LRU.

Until the cluster-wide store publishes KV events, the Conductor fills this from its
own decisions (a prefill instance keeps in its prefix cache the blocks it just
computed, until it runs out of room), as Dynamo's router does in its approximate
mode. Capacity per instance bounds the guess the way the engine's cache is bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

# A block's name: its chained hash (hex) in the cluster, a trace's hash id in the simulator.
BlockId = Hashable


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._holders: dict[BlockId, set[str]] = {}
        self._lru: dict[str, OrderedDict[BlockId, None]] = {}

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        return len(self._holders)

    def insert(self, instance_id: str, hashes: Iterable[BlockId]) -> list[BlockId]:
        """Record that `instance_id` holds these blocks (most recently used); returns
        the blocks it had to forget to stay within capacity."""
        lru = self._lru.setdefault(instance_id, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(instance_id)
        evicted = []
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            self._forget(h, instance_id)
            evicted.append(h)
        return evicted

    def remove_instance(self, instance_id: str) -> None:
        for h in self._lru.pop(instance_id, {}):
            self._forget(h, instance_id)

    def prefix_blocks(self, hashes: Sequence[BlockId], instances: Iterable[str]) -> dict[str, int]:
        """For each instance, how many leading blocks of `hashes` it holds."""
        result = dict.fromkeys(instances, 0)
        alive = set(result)
        for depth, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for iid in alive:
                result[iid] = depth + 1
        return result

    def used_blocks(self, instance_id: str) -> int:
        return len(self._lru.get(instance_id, ()))

    def holder_counts(self) -> list[int]:
        """For every indexed block, how many instances hold it."""
        return [len(holders) for holders in self._holders.values()]

    def _forget(self, h: BlockId, instance_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[h]
