"""The gateway's Prometheus metrics, in a registry the app owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
