"""An engine instance's Prometheus page: vLLM's own engine metrics (`vllm:*`: running
and waiting requests, KV-cache usage, prefix-cache hits, preemptions, TTFT, ITL and
step histograms), which vLLM's stat logger keeps in this process's default registry
once any stat logger is on (ours is: shared/engine/llm.py), each sample labelled with
the instance's id; and the instance's own load as its heartbeats report it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.instance import Instance

INSTANCE_LABEL = "instance_id"  # Prometheus keeps "instance" for the scrape target's address


class Labelled:
    """Every metric of another registry, with one label more."""

    def __init__(self, registry: CollectorRegistry, label: str, value: str) -> None:
        self.registry, self.label, self.value = registry, label, value

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, self.label: self.value}, s.value, s.timestamp, s.exemplar)
            yield out


class InstanceCollector:
    """The instance's load, read at scrape time from what its heartbeats send."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        i = self.instance
        labels, values = [INSTANCE_LABEL, "role", "node"], [i.instance_id, i.role, i.node]
        gauges = {
            "yuebing_instance_requests": ("Requests this instance runs now", len(i.requests)),
            "yuebing_instance_engine_waiting": ("Requests its engine's scheduler holds waiting", i.load.num_waiting),
            "yuebing_instance_kv_cache_usage_ratio": ("Share of its engine's KV cache in use", i.load.kv_usage),
            "yuebing_instance_slowdown": ("Its steps observed over the time model's (decode; 1 elsewhere)",
                                          i.slowdown()),
            "yuebing_instance_slowdown_evidence_seconds": (
                "Predicted seconds of recent work its slowdown rests on, each half-life counting half "
                "(0: none yet, and the slowdown is 1)", i.slowdown_evidence_s()),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        counters = (("yuebing_instance_served", "Requests it served to the end", i.served_total),
                    ("yuebing_instance_aborted", "Requests it stopped early", i.aborted_total),
                    ("yuebing_instance_token_chunks", "Token chunks it sent to gateways", i.outbox.chunks),
                    ("yuebing_instance_token_batches", "Messages those chunks went in: one per gateway per step",
                     i.outbox.batches),
                    ("yuebing_instance_token_batches_channelled", "Of those, the ones sent over a gateway's token "
                     "channel (the rest: over NATS)", i.outbox.channelled))
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family


def instance_registry(instance: Instance, engine_metrics: CollectorRegistry = REGISTRY) -> CollectorRegistry:
    """What the instance's /metrics renders."""
    registry = CollectorRegistry()
    registry.register(Labelled(engine_metrics, INSTANCE_LABEL, instance.instance_id))
    registry.register(InstanceCollector(instance))
    return registry
