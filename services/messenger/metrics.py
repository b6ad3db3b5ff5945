"""The messenger's Prometheus page: its counters and pool occupancy, read from
`Messenger.stats()` at scrape time (nothing is double-counted or kept twice), and
its guard (`Messenger.security()`): peers refused, stale notes dropped, whether
fault injection is on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.messenger.node import SecurityStats, Upkeep
from shared.messages import MessengerStats

COUNTERS = {
    "layers_out": "Block layers sent to other messengers",
    "layers_in": "Block layers received from other messengers",
    "bytes_out": "Payload bytes sent to other messengers",
    "bytes_in": "Payload bytes received from other messengers",
    "blocks_received": "Blocks that arrived complete and verified",
    "checksum_failures": "Blocks dropped for a bad checksum",
    "sends_dropped": "Layers that could not be queued for a peer",
    "evictions": "Blocks evicted from DRAM",
    "spills": "Evicted blocks written to the SSD tier",
    "ssd_dropped": "SSD files dropped as damaged",
    "misses": "Pins that found no block (DRAM or SSD)",
}
PEER_COUNTERS = {
    "peer_layers_out": "Block layers queued for each peer messenger (dropped ones included: sends_dropped)",
    "peer_bytes_out": "Payload bytes queued for each peer messenger",
}
GAUGES = {
    "pool_slots": "DRAM pool slots",
    "ready": "Blocks ready in DRAM",
    "filling": "Blocks arriving in DRAM",
    "pinned": "DRAM blocks pinned by in-flight requests",
    "ssd_blocks": "Blocks in the SSD tier",
}


SECURITY_COUNTERS = {
    "kv_peers_rejected": "Connections to the KV transfer port refused: the peer could not prove it holds "
                         "the cluster's key",
    "stale_notes": "Engine notes dropped: they named a slot that holds another block by now",
    "fault_commands_refused": "Fault commands refused: fault injection is off",
}
UPKEEP_COUNTERS = {
    "leases_lapsed": "Requests whose pins were released because their engine stopped renewing them",
    "peers_closed": "Peer messenger sockets closed: the peer went quiet or came back on another endpoint",
    "spills_skipped": "Evicted blocks not spilled to SSD: the writer's queue was full",
}
SECURITY_GAUGES = {
    "kv_authenticated": "1 when only holders of the cluster's KV key may send blocks here",
    "fault_injection_enabled": "1 when this messenger obeys fault commands (tests and drills)",
}


class StatsCollector:
    def __init__(
        self, stats: Callable[[], MessengerStats], security: Callable[[], SecurityStats] | None = None,
        upkeep: Callable[[], Upkeep] | None = None,
    ) -> None:
        self.stats = stats
        self.security = security
        self.upkeep = upkeep

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield from self._stats(s)
        if self.security is not None:
            yield from self._security(self.security())
        if self.upkeep is not None:
            yield from self._upkeep(s.node, self.upkeep())

    def _upkeep(self, node: str, u: Upkeep) -> Iterator[Metric]:
        for name, doc in UPKEEP_COUNTERS.items():
            family = CounterMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node"])
            family.add_metric([node], getattr(u, name))
            yield family

    def _security(self, s: SecurityStats) -> Iterator[Metric]:
        for name, doc in SECURITY_COUNTERS.items():
            family = CounterMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node"])
            family.add_metric([s.node], getattr(s, name))
            yield family
        for name, doc in SECURITY_GAUGES.items():
            family = GaugeMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node"])
            family.add_metric([s.node], int(getattr(s, name)))
            yield family

    def _stats(self, s: MessengerStats) -> Iterator[Metric]:
        hits = CounterMetricFamily("yuebing_messenger_hits", "Pinned blocks found, by tier", labels=["node", "tier"])
        hits.add_metric([s.node, "dram"], s.hits_dram)
        hits.add_metric([s.node, "ssd"], s.hits_ssd)
        yield hits
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node"])
            family.add_metric([s.node], getattr(s, name))
            yield family
        for name, doc in GAUGES.items():
            family = GaugeMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node"])
            family.add_metric([s.node], getattr(s, name))
            yield family
        for name, doc in PEER_COUNTERS.items():
            family = CounterMetricFamily(f"yuebing_messenger_{name}", doc, labels=["node", "peer"])
            for peer, value in sorted(getattr(s, name).items()):
                family.add_metric([s.node, peer], value)
            yield family


def serve(stats: Callable[[], MessengerStats], security: Callable[[], SecurityStats], port: int,
          host: str = "127.0.0.1", upkeep: Callable[[], Upkeep] | None = None) -> None:
    """Serve /metrics on a background thread (prometheus_client's own server)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(stats, security, upkeep))
    start_http_server(port, addr=host, registry=registry)
