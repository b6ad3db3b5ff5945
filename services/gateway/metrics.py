"""The gateway's Prometheus metrics, in a registry the app owns: requests and their
latencies, and what the gateway does under faults and overload (shedding, HTTP
timeouts and the connection cap, NATS clients lost and remade, event-loop lag)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
SLO_VERDICTS = ("met", "missed_ttft", "missed_tbt")
SHED_REASONS = ("queue_full", "queue_timeout")  # services/gateway/limits.py


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("yuebing_gateway_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("yuebing_gateway_requests_in_flight", "Requests being served", registry=r)
        self.prompt_tokens = Counter("yuebing_gateway_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("yuebing_gateway_cached_tokens", "Prompt tokens prefill reused (any tier, any node)", registry=r)
        self.kv_loaded_tokens = Counter(
            "yuebing_gateway_decode_kv_loaded_tokens", "Prompt tokens decode loaded from prefill's KV", registry=r
        )
        self.completion_tokens = Counter("yuebing_gateway_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("yuebing_gateway_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.slo = Counter("yuebing_gateway_slo", "Completed requests by SLO verdict", ["verdict"], registry=r)
        self.e2e = Histogram("yuebing_gateway_e2e_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self._faults(r)
        self._tenants(r)
        # Every label value known up front, at zero: a rate over a counter that has
        # never been counted is no data, and a dashboard or alert reads nothing.
        for verdict in SLO_VERDICTS:
            self.slo.labels(verdict)
        for reason in SHED_REASONS:
            self.shed.labels(reason)

    def _tenants(self, r: CollectorRegistry) -> None:
        """Each tenant's share of the figures above (tenant ids come from the tenants
        file, or `default`: the label's values are bounded). Only an operator reads them."""
        self.tenant_requests = Counter("yuebing_gateway_tenant_requests", "Requests by tenant and status",
                                       ["tenant", "status"], registry=r)
        self.tenant_refusals = Counter("yuebing_gateway_tenant_refusals", "429s by tenant and reason (quota_requests, "
                                       "quota_tokens, quota_streams: its own quota; overloaded; queue_full, "
                                       "queue_timeout: the gateway's own shedding)", ["tenant", "reason"], registry=r)
        self.tenant_prompt_tokens = Counter("yuebing_gateway_tenant_prompt_tokens", "Prompt tokens of served requests, "
                                            "by tenant", ["tenant"], registry=r)
        self.tenant_cached_tokens = Counter("yuebing_gateway_tenant_cached_tokens", "Prompt tokens prefill reused, by "
                                            "tenant (its own cache group's)", ["tenant"], registry=r)
        self.tenant_completion_tokens = Counter("yuebing_gateway_tenant_completion_tokens", "Generated tokens, by tenant",
                                                ["tenant"], registry=r)
        self.tenant_ttft = Histogram("yuebing_gateway_tenant_ttft_seconds", "Time to first token, by tenant",
                                     ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_tbt = Histogram("yuebing_gateway_tenant_tbt_seconds", "Mean time between tokens of a served "
                                    "request, by tenant", ["tenant"], buckets=LAG_BUCKETS, registry=r)

    def _faults(self, r: CollectorRegistry) -> None:
        """Overload and fault counters (issue 16)."""
        self.running = Gauge("yuebing_gateway_requests_running", "Requests holding a serving slot", registry=r)
        self.waiting = Gauge("yuebing_gateway_requests_waiting", "Requests queued for a serving slot", registry=r)
        self.shed = Counter("yuebing_gateway_shed", "Requests the gateway turned away with 429, by reason", ["reason"],
                            registry=r)
        self.slo_clamped = Counter("yuebing_gateway_slo_headers_clamped",
                                   "SLO headers looser than the cluster's, held to the cluster's", registry=r)
        self.connections = Gauge("yuebing_gateway_http_connections", "Open HTTP connections", registry=r)
        self.refused = Counter("yuebing_gateway_http_connections_refused", "Connections over the cap, answered 503",
                               registry=r)
        self.http_timeouts = Counter("yuebing_gateway_http_timeouts", "Connections or requests cut by a timeout, by phase",
                                     ["phase"], registry=r)  # header | body | write
        self.nats_events = Counter("yuebing_gateway_nats_events", "NATS client events", ["event"], registry=r)
        self.nats_errors = Counter("yuebing_gateway_nats_errors", "Requests failed with 503 by a NATS error, by error",
                                   ["error"], registry=r)
        self.loop_lag = Histogram("yuebing_gateway_loop_lag_seconds", "Event-loop lag, sampled by a ticker",
                                  buckets=LAG_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
