"""The connector's own decisions, outside vLLM (its KV paths run in tests/e2e)."""

from types import SimpleNamespace

from shared.kv_connector import Tracked, YuebingConnector
from shared.kv_wire import NO_ROOM, NOT_NEEDED, Reply


def test_a_step_naming_a_pool_that_is_gone_asks_the_messenger_once_not_per_layer():
    c = object.__new__(YuebingConnector)  # the decision alone: no engine, no messenger
    c.pool_id, c.gone_pool_id = "new", ""
    hellos = []
    c._map_pool = lambda: hellos.append(1) or True  # the node's pool is "new" now
    assert [c._pool_ready("old") for _layer in range(4)] == [False] * 4
    assert len(hellos) == 1
    assert c._pool_ready("new") and len(hellos) == 1  # the mapped pool needs no Hello
    assert not c._pool_ready("")


def test_prefill_tells_decode_how_many_leading_blocks_the_pool_took():
    # Three steps complete blocks 0-2, 3-5 and 6; the pool has no room for block 4, so
    # the run decode can load ends at block 3 (block 5 and 6 go, but past a gap).
    c = object.__new__(YuebingConnector)
    c.opts = SimpleNamespace(block_size=4)
    c.follower, c.pool_id = None, ""
    c._kv_cache_manager = SimpleNamespace(get_block_ids=lambda _rid: [list(range(100, 107))])
    replies = iter([[5, NOT_NEEDED, 7], [8, NO_ROOM, 9], [10]])
    c.client = SimpleNamespace(call=lambda _msg: Reply(pool_id="p", slots=next(replies)), note=lambda _note: None)
    t = Tracked(hashes=[bytes([i]) * 16 for i in range(7)], dest="node-1")
    c.tracked = {"r": t}
    saves = [c._reserve("r", t, done) for done in (3, 6, 7)]
    assert [[s.slot for s in step] for step in saves] == [[5, 7], [8, 9], [10]]
    assert c.request_finished(SimpleNamespace(request_id="r"), []) == (False, {"yb_coming": 4})
