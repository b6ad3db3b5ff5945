"""Where KV blocks are, as the Conductor knows it.

`PrefixIndex`: which prefill engine's own prefix cache holds which blocks. vLLM
publishes nothing about it here, so the Conductor fills it from its own decisions (an
engine keeps the blocks it just computed, until it runs out of room), as Dynamo's
router does in its approximate mode; capacity per instance bounds the guess the way
the engine's cache is bounded. The simulator uses it as the pool model too.

`PoolIndex`: which node pools (DRAM and SSD tiers) hold which blocks, exactly, from
the messengers' KV events and snapshots. Bounded per node (`max_node_blocks`, the
oldest stored forgotten first): a lost "evicted" event must not grow it for ever.
A departed node's blocks go with `remove_node`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence

# A block's name: its chained hash (hex) in the cluster, a trace's hash id in the simulator.
BlockId = Hashable
POOL_NODE_BLOCKS = 1 << 20  # blocks indexed per node at most (ClusterConfig.pool_index_node_blocks)


def leading_runs(
    hashes: Sequence[BlockId], holders: Mapping[BlockId, Collection[str]], candidates: Iterable[str] | None = None,
) -> dict[str, int]:
    """For each candidate, how many leading blocks of `hashes` it holds, given each
    block's holders; with no candidates, for each holder of the first block only."""
    result: dict[str, int] = {} if candidates is None else dict.fromkeys(candidates, 0)
    for depth, ids in runs_by_depth(hashes, holders, None if candidates is None else result):
        result.update(dict.fromkeys(ids, depth))
    return result


def runs_by_depth(hashes: Sequence[BlockId], holders: Mapping[BlockId, Collection[str]],
                  among: Collection[str] | None = None) -> list[tuple[int, set[str]]]:
    """The holders of the first block of `hashes` (or those `among` them), grouped
    by how many leading blocks each holds, shortest run first. One set intersection
    per block: the cost grows with the prompt's blocks and their holders, not with
    the fleet, and a block every instance holds costs C-level set operations, not a
    Python loop over the instances."""
    runs: list[tuple[int, set[str]]] = []
    alive = set(holders.get(hashes[0], ())) if hashes else set()
    if among is not None:
        alive.intersection_update(among)
    depth = 1
    while alive and depth < len(hashes):
        held = alive.intersection(holders.get(hashes[depth], ()))
        if len(held) < len(alive):
            runs.append((depth, alive - held))
        alive, depth = held, depth + 1
    if alive:
        runs.append((depth, alive))
    return runs


def without(items: tuple[str, ...], item: str) -> tuple[str, ...]:
    """`items` less `item` (which it holds once): the indexes keep holders in tuples."""
    i = items.index(item)
    return items[:i] + items[i + 1:]


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        # Holders as tuples, not sets: a tuple of strings leaves the cyclic collector's
        # books at its first collection, a set never does. A million indexed blocks held
        # in sets made every full collection a pause of about half a second.
        self._holders: dict[BlockId, tuple[str, ...]] = {}
        self._lru: dict[str, OrderedDict[BlockId, None]] = {}

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        return len(self._holders)

    def insert(self, instance_id: str, hashes: Iterable[BlockId]) -> list[BlockId]:
        """Record that `instance_id` holds these blocks (most recently used); returns
        the blocks it had to forget to stay within capacity."""
        lru = self._lru.setdefault(instance_id, OrderedDict())
        holders = self._holders
        for h in hashes:  # written out: every placement inserts its prompt's blocks
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            holders[h] = holders.get(h, ()) + (instance_id,)  # not yet among them: not in its lru
        evicted = []
        while len(lru) > self.capacity_blocks:
            h, _ = lru.popitem(last=False)
            self._forget(h, instance_id)
            evicted.append(h)
        return evicted

    def remove_instance(self, instance_id: str) -> None:
        for h in self._lru.pop(instance_id, {}):
            self._forget(h, instance_id)

    def prefix_blocks(self, hashes: Sequence[BlockId], instances: Iterable[str] | None = None) -> dict[str, int]:
        """For each instance, how many leading blocks of `hashes` it holds (no
        instances named: those that hold at least the first block)."""
        return leading_runs(hashes, self._holders, instances)

    def runs(self, hashes: Sequence[BlockId]) -> list[tuple[int, set[str]]]:
        """The instances holding a prefix of `hashes`, by its length, shortest first."""
        return runs_by_depth(hashes, self._holders)

    def used_blocks(self, instance_id: str) -> int:
        return len(self._lru.get(instance_id, ()))

    def holder_counts(self) -> list[int]:
        """For every indexed block, how many instances hold it."""
        return [len(holders) for holders in self._holders.values()]

    def _forget(self, h: BlockId, instance_id: str) -> None:
        held = self._holders.get(h, ())
        if instance_id in held:
            rest = without(held, instance_id)
            if rest:
                self._holders[h] = rest
            else:
                del self._holders[h]


class PoolIndex:
    """Which node pools hold which blocks, and in which tiers: the cluster-wide view
    that the messengers' KV events (and, after a restart, their snapshots) build."""

    def __init__(self, max_node_blocks: int = POOL_NODE_BLOCKS) -> None:
        if max_node_blocks <= 0:
            raise ValueError("max_node_blocks must be positive")
        self.max_node_blocks = max_node_blocks
        self._tiers: dict[BlockId, dict[str, tuple[str, ...]]] = {}  # block → node → tiers
        self._blocks: dict[str, dict[BlockId, None]] = {}  # node → blocks, least recently stored first

    def __len__(self) -> int:
        return len(self._tiers)

    def nodes(self) -> list[str]:
        return list(self._blocks)

    def node_blocks(self, node: str) -> int:
        return len(self._blocks.get(node, ()))

    def stored(self, node: str, tier: str, hashes: Iterable[BlockId]) -> None:
        blocks = self._blocks.setdefault(node, {})
        for h in hashes:
            nodes = self._tiers.setdefault(h, {})
            tiers = nodes.get(node, ())
            if tier not in tiers:
                nodes[node] = (*tiers, tier)  # a tuple: see PrefixIndex._holders
            blocks.pop(h, None)  # stored again: the most recent now
            blocks[h] = None
        while len(blocks) > self.max_node_blocks:
            self._forget(next(iter(blocks)), node)

    def evicted(self, node: str, tier: str, hashes: Iterable[BlockId]) -> None:
        """The blocks left `tier` on `node` (they may remain in another tier)."""
        for h in hashes:
            nodes = self._tiers.get(h, {})
            tiers = nodes.get(node, ())
            if tier in tiers:
                rest = without(tiers, tier)
                if rest:
                    nodes[node] = rest
                else:
                    self._forget(h, node)

    def removed(self, node: str, hashes: Iterable[BlockId]) -> None:
        for h in hashes:
            self._forget(h, node)

    def replace_node(self, node: str, tiers: dict[str, Iterable[BlockId]]) -> None:
        """Everything `node` holds, from its snapshot."""
        self.remove_node(node)
        for tier, hashes in tiers.items():
            self.stored(node, tier, hashes)

    def remove_node(self, node: str) -> None:
        for h in list(self._blocks.get(node, ())):
            self._forget(h, node)
        self._blocks.pop(node, None)

    def prefix_blocks(self, hashes: Sequence[BlockId], nodes: Iterable[str] | None = None) -> dict[str, int]:
        """For each node, how many leading blocks of `hashes` its pool holds (any tier;
        no nodes named: those that hold at least the first block)."""
        return leading_runs(hashes, self._tiers, nodes)

    def _forget(self, h: BlockId, node: str) -> None:
        nodes = self._tiers.get(h)
        if nodes is not None:
            nodes.pop(node, None)
            if not nodes:
                del self._tiers[h]
        blocks = self._blocks.get(node)
        if blocks is not None:
            blocks.pop(h, None)
