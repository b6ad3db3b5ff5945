"""The Conductor's Prometheus page: its decisions and books, as a scrape reads them."""

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.conductor.metrics import ConductorMetrics, load_ratio
from shared import metrics_page
from shared.messages import RequestUpdate
from tests.conductor.test_app import ask, conductor


def scrape(metrics: ConductorMetrics) -> dict[str, list]:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family, **labels) -> float:
    return next(s.value for s in family.samples if s.labels == labels and not s.name.endswith("_created"))


def test_a_scrape_counts_decisions_by_outcome_mode_and_cause_and_reads_the_books():
    c = conductor((("p0", "prefill"), ("d0", "decode")), admission="predictive", slo_ttft_ms=50.0)
    clock = [0.001]
    metrics = ConductorMetrics(c, clock=lambda: clock[0])
    assert c.schedule(ask("r1", ["a"]), now=0.0).accepted
    refused = c.schedule(ask("r2", [f"b{i}" for i in range(15)]), now=0.0)  # 1,925 tokens: far over 50 ms
    assert not refused.accepted
    metrics.decision.observe(0.0004)
    f = scrape(metrics)
    assert value(f["yuebing_conductor_requests"], outcome="accepted") == 1
    assert value(f["yuebing_conductor_requests"], outcome="rejected") == 1
    assert value(f["yuebing_conductor_rejections"], cause="ttft_slo") == 1
    assert value(f["yuebing_conductor_placements"], mode="disaggregated", reason="mode") == 1
    assert value(f["yuebing_conductor_prefill_queue_seconds"], instance="p0") > 0  # r1 is booked there
    assert value(f["yuebing_conductor_decode_batch"], instance="d0") == 0  # its prefill has not ended
    assert value(f["yuebing_conductor_instances"], role="prefill") == value(f["yuebing_conductor_instances"],
                                                                            role="decode") == 1
    assert value(f["yuebing_conductor_slowdown"], instance="d0") == 1.0
    assert f["yuebing_conductor_decision_seconds"].type == "histogram"
    assert all(family.documentation for family in f.values())  # every metric says what it is
    queued = value(f["yuebing_conductor_prefill_queue_seconds"], instance="p0")
    assert value(f["yuebing_conductor_prefill_load_ratio"]) == pytest.approx(queued / 0.05)  # one prefill instance
    assert value(f["yuebing_conductor_decode_load_ratio"]) == 0  # nothing decoding
    c.on_update(RequestUpdate(request_id="r1", kind="prefill_done"), now=0.05)
    clock[0] = 0.06
    assert value(scrape(metrics)["yuebing_conductor_decode_batch"], instance="d0") == 1
    assert value(scrape(metrics)["yuebing_conductor_decode_load_ratio"]) > 0


def test_a_roles_load_ratio_is_its_instances_mean_over_the_slo():
    assert load_ratio([0.1, 0.3], slo_s=0.4) == pytest.approx(0.5)
    assert load_ratio([], slo_s=0.4) == 0.0 and load_ratio([0.1], slo_s=0.0) == 0.0


@pytest.mark.asyncio
async def test_the_page_asks_for_the_key_when_it_has_one():
    metrics = ConductorMetrics(conductor(), clock=lambda: 0.1)
    async with TestClient(TestServer(metrics_page.page(metrics.registry, key="s3cret"))) as client:
        refused = await client.get("/metrics")
        assert refused.status == 401 and (await refused.json())["error"]["code"] == "invalid_api_key"
        page = await client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert page.status == 200 and "yuebing_conductor_requests_total" in await page.text()
    async with TestClient(TestServer(metrics_page.page(metrics.registry))) as client:
        assert (await client.get("/metrics")).status == 200  # no key: open, as the gateway's by default


def test_a_scrape_counts_the_other_conductors_heard_lost_and_booked_from():
    from shared.messages import BookDigest
    from tests.conductor.test_bookings import conductor as sharing

    a, b = sharing("conductor"), sharing("conductor-1")
    metrics = ConductorMetrics(b, clock=lambda: 0.0)
    a.schedule(ask("r1", ["h1"]), now=0.0)
    b.on_digest(BookDigest(conductor="conductor", incarnation="i0", bookings=[x for x, _ in a.digest.bookings]), now=0.0)
    f = scrape(metrics)
    assert value(f["yuebing_conductor_peers"]) == 1 and value(f["yuebing_conductor_peer_bookings"]) == 1
    assert value(f["yuebing_conductor_peers_lost"]) == 0
    b.forget_lost_peers(now=b.config.liveness_timeout_s + 0.1)
    f = scrape(metrics)
    assert value(f["yuebing_conductor_peers"]) == 0 and value(f["yuebing_conductor_peers_lost"]) == 1
