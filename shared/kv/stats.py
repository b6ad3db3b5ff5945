"""What the connector did, counted where it happens and shown on the instance's
/metrics page. vLLM carries it there: each step the worker half's counts travel with
the step's output to the engine core, which adds the scheduler half's and hands the
sum to its Prometheus logger in the instance's process (`KVStats`, `KVPromMetrics`).

Counts are of the step, or since the scheduler half last gave them: each half
`take`s its counts, which starts them again from zero."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = ("saved_blocks", "saved_bytes", "loaded_blocks", "loaded_bytes")
# Why a block that was to be loaded was computed instead.
FAILURE_CAUSES = ("gone_before_pinned", "pool_unavailable", "copy_failed")
TIMINGS = ("load_wait_s", "save_flush_s")  # observations, seconds: one per step that had the work
PREFIX = "yuebing_kv_"
TIME_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


def empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), "failed": dict.fromkeys(FAILURE_CAUSES, 0),
            **{name: [] for name in TIMINGS}}


@dataclass
class Counts:
    """One half's counts since it last gave them."""

    data: dict[str, Any] = field(default_factory=empty)

    def add(self, name: str, value: int) -> None:
        self.data[name] += value

    def failed(self, cause: str, blocks: int) -> None:
        self.data["failed"][cause] += blocks

    def timed(self, name: str, seconds: float) -> None:
        self.data[name].append(seconds)

    def take(self) -> KVStats | None:
        """The counts, and zero again; None if nothing happened (most steps: nothing
        is allocated then)."""
        stats = KVStats(self.data)
        if stats.is_empty():
            return None
        self.data = empty()
        return stats


@dataclass
class KVStats(KVConnectorStats):
    """vLLM's container for a connector's counts: it adds those of every worker and of
    the scheduler half, and sends them between processes as `data` (plain values)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> KVStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for cause, blocks in other.data.get("failed", {}).items():
            self.data["failed"][cause] = self.data["failed"].get(cause, 0) + blocks
        for name in TIMINGS:
            self.data[name].extend(other.data.get(name, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        failed = sum(self.data["failed"].values())
        return {**{name: self.data[name] for name in COUNTERS}, "failed_blocks": failed}

    def is_empty(self) -> bool:
        return (not any(self.data[name] for name in (*COUNTERS, *TIMINGS))
                and not any(self.data["failed"].values()))


class KVPromMetrics(KVConnectorPromMetrics):
    """The connector's families, one child per engine as vLLM labels them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        forget_earlier_families()
        counters = {
            "saved_blocks": "KV blocks this engine saved into the node pool",
            "saved_bytes": "Bytes of KV this engine saved into the node pool",
            "loaded_blocks": "KV blocks this engine loaded from the node pool instead of computing them",
            "loaded_bytes": "Bytes of KV this engine loaded from the node pool",
        }
        self.counters = {name: self._per_engine(self._counter_cls, f"{PREFIX}{name}", doc)
                         for name, doc in counters.items()}
        failed = self._counter_cls(name=f"{PREFIX}load_failed_blocks",
                                   documentation="KV blocks that were to be loaded and were computed, by cause",
                                   labelnames=[*labelnames, "cause"])
        self.failed = {engine: {cause: failed.labels(*values, cause) for cause in FAILURE_CAUSES}
                       for engine, values in per_engine_labelvalues.items()}
        timings = {
            "load_wait_s": (f"{PREFIX}load_wait_seconds", "Time a step's forward waited for its KV loads"),
            "save_flush_s": (f"{PREFIX}save_flush_seconds",
                             "Time a step's end waited for its KV saves to read their blocks"),
        }
        self.timings = {name: self._per_engine(self._histogram_cls, metric, doc, buckets=TIME_BUCKETS_S)
                        for name, (metric, doc) in timings.items()}

    def _per_engine(self, kind: type, name: str, doc: str, **kwargs: Any) -> dict[int, Any]:
        family = kind(name=name, documentation=doc, labelnames=self._labelnames, **kwargs)
        return {engine: family.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self.counters.items():
            if value := transfer_stats_data.get(name, 0):
                children[engine_idx].inc(value)
        for cause, blocks in transfer_stats_data.get("failed", {}).items():
            if blocks and cause in self.failed[engine_idx]:
                self.failed[engine_idx][cause].inc(blocks)
        for name, children in self.timings.items():
            for seconds in transfer_stats_data.get(name, ()):
                children[engine_idx].observe(seconds)


def families_in(registry: CollectorRegistry, labelnames: list[str],
                per_engine_labelvalues: dict[int, list[object]]) -> KVPromMetrics:
    """The connector's families registered in `registry` rather than the process's
    (the metrics reference lists them; tests read them)."""
    kinds = {kind: (lambda kind=kind, **kw: kind(registry=registry, **kw)) for kind in (Counter, Gauge, Histogram)}
    return KVPromMetrics(SimpleNamespace(kv_transfer_config=None), kinds, labelnames, per_engine_labelvalues)


def forget_earlier_families() -> None:
    """A second engine in one process (tests build several) registers the families
    again: the first engine's go, as vLLM's own do (unregister_vllm_metrics)."""
    for collector in list(REGISTRY._collector_to_names):  # prometheus_client has no public way to list them
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)
