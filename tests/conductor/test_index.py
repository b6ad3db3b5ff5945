import gc

import pytest

from services.conductor.index import PoolIndex, PrefixIndex


def test_prefix_counts_leading_blocks_per_instance():
    ix = PrefixIndex(capacity_blocks=100)
    ix.insert("a", ["h1", "h2", "h3"])
    ix.insert("b", ["h1", "x2"])
    assert ix.prefix_blocks(["h1", "h2", "h3", "h4"], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    # Holding a block is not enough: the blocks before it must be held too.
    assert ix.prefix_blocks(["x1", "h2"], ["a"]) == {"a": 0}
    assert len(ix) == 4
    # No instances named: only those holding the first block, each with its run.
    assert ix.prefix_blocks(["h1", "h2", "h3", "h4"]) == {"a": 3, "b": 1}
    assert ix.prefix_blocks(["h2"]) == {"a": 1} and ix.prefix_blocks([]) == {}


def test_runs_end_where_each_holder_stops_holding():
    ix = PrefixIndex(capacity_blocks=100)
    hashes = [f"h{i}" for i in range(6)]
    for n, iid in enumerate(["a", "b", "c", "d", "e", "f"], start=1):
        ix.insert(iid, hashes[:n])
    ix.insert("g", hashes[1:])  # holds all but the first: no run
    assert ix.prefix_blocks(hashes) == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}
    assert ix.prefix_blocks(hashes, ["c", "g", "z"]) == {"c": 3, "g": 0, "z": 0}


def test_lru_capacity_forgets_least_recent_and_instances_can_leave():
    ix = PrefixIndex(capacity_blocks=2)
    ix.insert("a", ["h1", "h2"])
    ix.insert("a", ["h1"])  # touch h1
    assert ix.insert("a", ["h3"]) == ["h2"]
    assert ix.prefix_blocks(["h1"], ["a"]) == {"a": 1}
    ix.remove_instance("a")
    assert len(ix) == 0 and ix.used_blocks("a") == 0
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_pool_index_prefix_by_node_across_tiers():
    from services.conductor.index import PoolIndex

    idx = PoolIndex()
    idx.stored("n0", "dram", ["a", "b"])
    idx.stored("n1", "ssd", ["a", "b", "c"])
    idx.stored("n1", "dram", ["a"])
    assert idx.prefix_blocks(["a", "b", "c", "d"], ["n0", "n1", "n2"]) == {"n0": 2, "n1": 3, "n2": 0}
    idx.evicted("n1", "dram", ["a"])  # still on SSD there
    assert idx.prefix_blocks(["a"], ["n0", "n1"]) == {"n0": 1, "n1": 1}
    idx.evicted("n1", "ssd", ["a"])  # gone from its last tier there
    assert idx.prefix_blocks(["a"], ["n0", "n1"]) == {"n0": 1, "n1": 0}
    idx.stored("n1", "ssd", ["a"])
    idx.removed("n0", ["b"])
    assert idx.prefix_blocks(["a", "b"], ["n0", "n1"]) == {"n0": 1, "n1": 2}
    idx.replace_node("n1", {"dram": ["z"]})
    assert idx.prefix_blocks(["a", "b", "c"], ["n1"]) == {"n1": 0}
    assert idx.prefix_blocks(["z"], ["n1"]) == {"n1": 1}
    idx.remove_node("n1")
    assert len(idx) == 1


def test_pool_index_is_bounded_per_node_oldest_stored_first():
    from services.conductor.index import PoolIndex

    idx = PoolIndex(max_node_blocks=3)
    idx.stored("n0", "dram", ["a", "b", "c"])
    idx.stored("n0", "ssd", ["a"])  # stored again: the most recent now
    idx.stored("n0", "dram", ["d"])  # b goes, the oldest
    assert idx.node_blocks("n0") == 3
    assert idx.prefix_blocks(["a"], ["n0"]) == {"n0": 1} and idx.prefix_blocks(["b"], ["n0"]) == {"n0": 0}
    idx.stored("n1", "dram", ["x", "y", "z"])  # another node's bound is its own
    assert idx.node_blocks("n1") == 3 and len(idx) == 6
    with pytest.raises(ValueError):
        PoolIndex(0)


def test_a_departed_node_leaves_the_pool_index_whole():
    from services.conductor.index import PoolIndex

    idx = PoolIndex()
    idx.stored("n0", "dram", ["a", "b"])
    idx.stored("n1", "ssd", ["a"])
    idx.remove_node("n0")
    assert idx.nodes() == ["n1"] and len(idx) == 1 and idx.node_blocks("n0") == 0


def test_no_indexed_block_leaves_a_container_for_the_cyclic_collector():
    """A million indexed blocks in sets made each full collection a pause of about
    half a second; in tuples of strings they leave the collector's books."""
    index = PrefixIndex(capacity_blocks=100)
    index.insert("p0", ["a", "b"])
    index.insert("p1", ["a"])
    pool = PoolIndex()
    pool.stored("n0", "dram", ["a", "b"])
    pool.stored("n0", "ssd", ["a"])
    pool.evicted("n0", "dram", ["a"])
    gc.collect()
    assert index.prefix_blocks(["a", "b"]) == {"p0": 2, "p1": 1} and pool.prefix_blocks(["a", "b"]) == {"n0": 2}
    assert not any(gc.is_tracked(v) for v in [*index._holders.values(), *pool._tiers.values()])
