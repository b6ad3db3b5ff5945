"""Every process's Prometheus page on a live cluster: the launcher lists each in its
ready file, and a scrape after a request reads data from it."""

from __future__ import annotations

import pytest

from tests.e2e.ops import scrape

pytestmark = pytest.mark.e2e


def test_the_conductors_page_counts_the_decisions_it_made_and_reads_its_books(client, cluster):
    assert {"gateway", "conductor", "messenger-0"} <= set(cluster.metrics)
    before = scrape(cluster.metrics["conductor"]).get("yuebing_conductor_decision_seconds_count[]", 0.0)
    client.chat.completions.create(model="yuebing-tiny", messages=[{"role": "user", "content": "Hello there"}],
                                   temperature=0, max_tokens=4)
    after = scrape(cluster.metrics["conductor"])
    assert after["yuebing_conductor_decision_seconds_count[]"] >= before + 1
    assert after["yuebing_conductor_requests_total[('outcome', 'accepted')]"] >= 1
    assert after["yuebing_conductor_instances[('role', 'prefill')]"] >= 1
    assert after["yuebing_conductor_instances[('role', 'decode')]"] >= 1
    assert any(name.startswith("yuebing_conductor_slowdown[") for name in after)


def test_each_engine_instance_serves_vllms_metrics_under_its_id_and_its_own_load(client, cluster):
    client.chat.completions.create(model="yuebing-tiny", messages=[{"role": "user", "content": "Hello again"}],
                                   temperature=0, max_tokens=4)
    engines = [name for name in cluster.metrics if name.startswith(("prefill-", "decode-"))]
    assert any(n.startswith("prefill-") for n in engines) and any(n.startswith("decode-") for n in engines)
    for name in engines:
        page = scrape(cluster.metrics[name])
        vllm = [key for key in page if key.startswith("vllm:")]
        assert vllm and all(f"('instance_id', '{name}')" in key for key in vllm), name
        assert any(key.startswith("yuebing_instance_served_total") for key in page), name
    served = sum(v for name in engines for key, v in scrape(cluster.metrics[name]).items()
                 if key.startswith("yuebing_instance_served_total"))
    assert served >= 1


def test_decode_streams_the_gateways_tokens_over_its_token_channel(client, cluster):
    def channelled() -> tuple[float, float]:
        gateway = scrape(cluster.metrics["gateway"]).get("yuebing_gateway_token_batches_total[('way', 'channel')]", 0.0)
        decodes = [scrape(url) for name, url in cluster.metrics.items() if name.startswith("decode-")]
        sent = sum(v for page in decodes for k, v in page.items()
                   if k.startswith("yuebing_instance_token_batches_channelled"))
        return gateway, sent

    # A gateway's first request to a decode instance may stream over NATS while its channel opens.
    for attempt in range(5):
        client.chat.completions.create(model="yuebing-tiny", messages=[{"role": "user", "content": f"Hi {attempt}"}],
                                       temperature=0, max_tokens=6)
        if min(channelled()) >= 1:
            return
    pytest.fail(f"no token batch over a token channel (gateway took, decode sent): {channelled()}")
