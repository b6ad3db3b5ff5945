"""The messenger's Prometheus page follows its stats."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.messenger.metrics import StatsCollector
from services.messenger.node import SecurityStats, Upkeep
from shared.messages import MessengerStats

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def page(stats: MessengerStats, security: SecurityStats | None = None) -> Samples:
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: stats, (lambda: security) if security else None))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_scrape_shows_what_changed_and_nothing_else():
    before = MessengerStats(node="node-7", hits_dram=5, ready=4)
    after = msgspec.structs.replace(before, bytes_in=1024, hits_ssd=2, ready=3)
    old, new = page(before), page(after)
    changed = {key: value for key, value in new.items() if old.get(key) != value}
    node = ("node", "node-7")
    assert changed == {
        ("yuebing_messenger_bytes_in_total", (node,)): 1024,
        ("yuebing_messenger_hits_total", (node, ("tier", "ssd"))): 2,
        ("yuebing_messenger_ready", (node,)): 3,
    }


def test_what_went_to_each_peer_is_counted_by_peer():
    samples = page(MessengerStats(node="node-0", peer_layers_out={"node-1": 8, "node-2": 2},
                                  peer_bytes_out={"node-1": 4096, "node-2": 1024}))
    assert samples[("yuebing_messenger_peer_bytes_out_total", (("node", "node-0"), ("peer", "node-1")))] == 4096
    assert samples[("yuebing_messenger_peer_layers_out_total", (("node", "node-0"), ("peer", "node-2")))] == 2


def test_every_sample_names_its_node():
    assert {dict(labels)["node"] for _, labels in page(MessengerStats(node="n")).keys()} == {"n"}


def test_what_was_let_go_to_stay_bounded_is_counted_on_the_page():
    registry = CollectorRegistry()
    upkeep = Upkeep(leases_lapsed=3, peers_closed=1, spills_skipped=2)
    registry.register(StatsCollector(lambda: MessengerStats(node="n"), upkeep=lambda: upkeep))
    text = generate_latest(registry).decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["yuebing_messenger_leases_lapsed_total"] == 3
    assert samples["yuebing_messenger_peers_closed_total"] == 1
    assert samples["yuebing_messenger_spills_skipped_total"] == 2
