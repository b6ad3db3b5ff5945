"""The connector's own decisions, outside vLLM (its KV paths run in tests/e2e)."""

from shared.kv_connector import YuebingConnector


def test_a_step_naming_a_pool_that_is_gone_asks_the_messenger_once_not_per_layer():
    c = object.__new__(YuebingConnector)  # the decision alone: no engine, no messenger
    c.pool_id, c.gone_pool_id = "new", ""
    hellos = []
    c._map_pool = lambda: hellos.append(1) or True  # the node's pool is "new" now
    assert [c._pool_ready("old") for _layer in range(4)] == [False] * 4
    assert len(hellos) == 1
    assert c._pool_ready("new") and len(hellos) == 1  # the mapped pool needs no Hello
    assert not c._pool_ready("")
