"""The connector's counts: taken from each half, added up as vLLM adds them (every
worker's, then the scheduler half's), and recorded into Prometheus families."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared.kv.stats import Counts, KVStats, families_in


def test_counts_are_taken_once_and_nothing_is_none():
    counts = Counts()
    assert counts.take() is None
    counts.add("saved_blocks", 2)
    counts.timed("load_wait_s", 0.01)
    taken = counts.take()
    assert taken is not None and taken.data["saved_blocks"] == 2 and taken.data["load_wait_s"] == [0.01]
    assert counts.take() is None


def test_two_workers_and_the_scheduler_half_add_up():
    first, second, scheduler = Counts(), Counts(), Counts()
    first.add("saved_bytes", 100)
    second.add("saved_bytes", 50)
    second.timed("save_flush_s", 0.002)
    scheduler.failed("gone_before_pinned", 3)
    total = first.take().aggregate(second.take()).aggregate(scheduler.take())
    assert total.data["saved_bytes"] == 150 and total.data["save_flush_s"] == [0.002]
    assert total.data["failed"]["gone_before_pinned"] == 3
    assert total.reduce()["failed_blocks"] == 3
    # Between processes it travels as its data: rebuilt, it is the same.
    assert KVStats(data=total.to_dict()).data == total.data and KVStats().is_empty()


def test_prometheus_families_get_each_engines_counts():
    registry = CollectorRegistry()
    metrics = families_in(registry, ["model_name", "engine"], {0: ["m", "0"]})
    counts = Counts()
    counts.add("loaded_blocks", 4)
    counts.failed("copy_failed", 1)
    counts.timed("load_wait_s", 0.003)
    metrics.observe(counts.take().to_dict(), engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("yuebing_kv_loaded_blocks_total", labels) == 4
    assert registry.get_sample_value("yuebing_kv_load_failed_blocks_total", {**labels, "cause": "copy_failed"}) == 1
    assert registry.get_sample_value("yuebing_kv_load_wait_seconds_count", labels) == 1
