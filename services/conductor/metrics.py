"""The Conductor's Prometheus page: its decisions (how long each took, placements by
serving mode and reason, rejections by cause), and its books as they stand at scrape
time (each prefill instance's predicted queue, each decode instance's batch and
predicted step against the TBT SLO, the calibration factors, the pool index, the
roles). Read from the Conductor between its handlers: nothing is kept twice."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.conductor.policy import CAUSES
from shared.metrics_page import FAST_BUCKETS

if TYPE_CHECKING:  # the Conductor's module wires this one in
    from services.conductor.app import Conductor


class ConductorMetrics:
    """The registry /metrics renders: the decision histogram the handler observes,
    and a collector over the Conductor's own counters and books."""

    def __init__(self, conductor: Conductor, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self.decision = Histogram("yuebing_conductor_decision_seconds", "Time to decide one schedule request",
                                  buckets=FAST_BUCKETS, registry=self.registry)
        self.registry.register(BooksCollector(conductor, clock))


class BooksCollector:
    def __init__(self, conductor: Conductor, clock: Callable[[], float]) -> None:
        self.conductor = conductor
        self.clock = clock  # the Conductor's own: its books are kept on time.monotonic

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        yield from self._decisions()
        yield from self._books(now)
        yield from self._roles(now)
        yield from self._peers()

    def _decisions(self) -> Iterator[Metric]:
        c = self.conductor
        requests = CounterMetricFamily("yuebing_conductor_requests", "Schedule requests answered, by outcome",
                                       labels=["outcome"])
        for outcome, n in (("accepted", c.counts["accepted"]), ("rejected", c.rejected),
                           ("replaced_decode", c.counts["replaced_decode"])):
            requests.add_metric([outcome], n)
        yield requests
        yield _counter("yuebing_conductor_rejections", "Requests refused, by cause (ttft_slo, tbt_slo, no_room, "
                       "no_instance; fair_share, shed_class: among tenants once loaded; quota: a tenant's own "
                       "limit, not the cluster's load)", "cause",
                       {cause: c.rejections.get(cause, 0) for cause in (*CAUSES, "quota")})
        quotas = CounterMetricFamily("yuebing_conductor_quota_refusals", "Requests refused over their tenant's quota, "
                                     "by tenant (the tenants file's ids) and limit", labels=["tenant", "limit"])
        for (tenant, limit), n in sorted(c.quota_refusals.items()):
            quotas.add_metric([tenant, limit], n)
        yield quotas
        modes = CounterMetricFamily("yuebing_conductor_placements", "Accepted requests by serving mode and reason",
                                    labels=["mode", "reason"])
        for key, n in sorted(c.modes.items()):
            modes.add_metric(key.split(":", 1), n)
        yield modes
        yield _counter("yuebing_conductor_prefill_routes", "Prefills by CPP route and reason", "route", c.routes)
        wasted = CounterMetricFamily("yuebing_conductor_wasted_prefills", "Prefills whose decode refused them")
        wasted.add_metric([], c.counts["wasted_prefill"])
        yield wasted

    def _books(self, now: float) -> Iterator[Metric]:
        c = self.conductor
        view = c.view_now(now)
        queue = GaugeMetricFamily("yuebing_conductor_prefill_queue_seconds",
                                  "Predicted work ahead on each prefill instance, calibrated", labels=["instance"])
        step = GaugeMetricFamily("yuebing_conductor_decode_step_seconds",
                                 "Predicted decode step of each decode instance's batch now, calibrated",
                                 labels=["instance"])
        batch = GaugeMetricFamily("yuebing_conductor_decode_batch", "Requests each decode instance decodes now",
                                  labels=["instance"])
        pace = GaugeMetricFamily("yuebing_conductor_slowdown",
                                 "Each instance's predicted times are multiplied by this (observed over predicted)",
                                 labels=["instance"])
        queues, steps = [], []
        for x in view.prefills:
            queues.append(x.slowdown * x.queue_s)
            queue.add_metric([x.instance_id], queues[-1])
            pace.add_metric([x.instance_id], x.slowdown)
        for x in view.decodes:
            n, ctx = x.at(now)
            batch.add_metric([x.instance_id], n)
            steps.append(x.slowdown * c.state.predictor.decode_step_s(n, ctx))
            step.add_metric([x.instance_id], steps[-1])
            pace.add_metric([x.instance_id], x.slowdown)
        yield from (queue, step, batch, pace)
        yield _gauge("yuebing_conductor_prefill_load_ratio", "The autoscalers' signal for prefill: the mean predicted "
                     "queue of the prefill instances over the TTFT SLO (0: idle; 1: a new request waits its whole "
                     "budget)", load_ratio(queues, c.config.slo_ttft_ms / 1e3))
        yield _gauge("yuebing_conductor_decode_load_ratio", "The autoscalers' signal for decode: the mean predicted step "
                     "of the decode instances over the TBT SLO (1: no headroom left)",
                     load_ratio(steps, c.config.slo_tbt_ms / 1e3))
        yield _gauge("yuebing_conductor_slo_tbt_seconds", "The cluster's default TBT SLO", c.config.slo_tbt_ms / 1e3)
        yield _gauge("yuebing_conductor_decode_time_seconds", "How long a request is taken to decode (t_d, learned)",
                     c.state.decode_time_s)
        yield _gauge("yuebing_conductor_pool_index_blocks", "Distinct blocks in the cluster-wide pool index",
                     len(c.pools))

    def _roles(self, now: float) -> Iterator[Metric]:
        c = self.conductor
        live = GaugeMetricFamily("yuebing_conductor_instances", "Live engine instances by the role they serve now",
                                 labels=["role"])
        engines = c.engines(now)
        for role in ("prefill", "decode"):
            live.add_metric([role], sum(1 for hb in engines if c.roles.of(hb) == role))
        yield live
        changes = CounterMetricFamily("yuebing_conductor_role_changes", "Role changes the planner started")
        changes.add_metric([], c.roles.changes)
        yield changes


    def _peers(self) -> Iterator[Metric]:
        """With other Conductors (sync.py): how many it hears, and what their digests brought."""
        c = self.conductor
        yield _gauge("yuebing_conductor_peers", "Other Conductors whose digests arrive", len(c.peers.seen_at))
        lost = CounterMetricFamily("yuebing_conductor_peers_lost", "Other Conductors whose digests stopped, or that restarted")
        lost.add_metric([], c.peers.lost_total)
        yield lost
        booked = CounterMetricFamily("yuebing_conductor_peer_bookings", "Placements booked from other Conductors")
        booked.add_metric([], c.peer_bookings)
        yield booked


def load_ratio(seconds: list[float], slo_s: float) -> float:
    """The mean of `seconds` (one per instance of a role) over the SLO they count
    against; 0 with no instance or no SLO. One number per role that both Conductors
    report alike (they share their books), for an autoscaler to hold at a target."""
    if not seconds or slo_s <= 0:
        return 0.0
    return sum(seconds) / len(seconds) / slo_s


def _counter(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([key], n)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family
