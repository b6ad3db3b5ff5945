"""The engine's view of the node pool, kept from the messenger's events."""

from __future__ import annotations

import time

from shared.kv.client import HelloWatch, PoolFollower
from shared.kv.wire import FAILED_MEMORY_S, BlockEvent, Reply, Snapshot


class Messenger:
    """Answers a snapshot of pool "p1" holding one block."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def call(self, message: object) -> Reply:
        self.calls.append(message)
        return Reply(pool_id="p1", ready=[b"s" * 16])


def follower(tmp_path) -> tuple[PoolFollower, Messenger]:
    messenger = Messenger()
    f = PoolFollower(str(tmp_path), "n", messenger)  # type: ignore[arg-type]
    f.close()  # its thread reads nothing here: the test hands it the events
    return f, messenger


def test_a_new_pool_is_followed_from_its_snapshot_then_from_events(tmp_path):
    f, messenger = follower(tmp_path)
    f._apply(BlockEvent(kind="ready", pool_id="p1", hashes=[b"a" * 16]))
    assert messenger.calls == [Snapshot()]
    assert f.ready == {b"s" * 16, b"a" * 16}
    f._apply(BlockEvent(kind="evicted", pool_id="p1", hashes=[b"s" * 16]))
    assert f.ready == {b"a" * 16} and len(messenger.calls) == 1
    f._apply(BlockEvent(kind="tick", pool_id="p2"))  # the messenger restarted: its old pool is gone
    assert f.ready == set() and f.pool_id == "p2" and f.alive


def test_a_failed_block_is_remembered_for_a_while(tmp_path):
    f, _ = follower(tmp_path)
    f._apply(BlockEvent(kind="failed", pool_id="p1", hashes=[b"x" * 16]))
    assert f.has_failed(b"x" * 16) and not f.has_failed(b"y" * 16)
    f.failed[b"x" * 16] = time.monotonic() - FAILED_MEMORY_S
    assert not f.has_failed(b"x" * 16)


def test_the_messenger_is_dead_when_its_ticks_stop(tmp_path):
    f, _ = follower(tmp_path)
    assert not f.alive
    f._apply(BlockEvent(kind="tick", pool_id="p1"))
    assert f.alive
    f.last_tick -= f.dead_after_s
    assert not f.alive


def test_the_hello_watch_says_hello_to_a_messenger_holding_no_pool_at_most_once_a_retry(tmp_path):
    hellos: list[float] = []
    w = HelloWatch(str(tmp_path), "n", lambda: hellos.append(1), retry_s=1.0)
    w.close()  # its thread reads nothing here: the test hands it the events
    assert not w.saw(BlockEvent(kind="tick", pool_id="p1"), now=0.0)  # a carved pool: nothing to do
    assert w.saw(BlockEvent(kind="tick", pool_id=""), now=0.0)  # restarted, unattached
    assert not w.saw(BlockEvent(kind="tick", pool_id=""), now=0.5)  # asked already
    assert not w.saw(BlockEvent(kind="ready", pool_id=""), now=2.0)  # only ticks say so
    assert w.saw(BlockEvent(kind="tick", pool_id=""), now=2.0)
    assert len(hellos) == 2


def test_a_failing_hello_does_not_stop_the_watch(tmp_path):
    def refuse() -> None:
        raise RuntimeError("no")

    w = HelloWatch(str(tmp_path), "n", refuse)
    w.close()
    assert w.saw(BlockEvent(kind="tick", pool_id=""), now=0.0)
