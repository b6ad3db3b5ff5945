"""The messenger's Prometheus page, scraped over HTTP."""

from __future__ import annotations

import urllib.request

from services.messenger.metrics import serve
from shared.messages import MessengerStats
from yuebing.launcher import free_port


def test_metrics_page_shows_hits_by_tier_traffic_and_occupancy():
    stats = MessengerStats(node="node-7", pool_slots=10, ready=4, pinned=1, ssd_blocks=3, hits_dram=5, hits_ssd=2,
                           misses=1, bytes_in=1024, evictions=6)
    port = free_port()
    serve(lambda: stats, port)
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'yuebing_messenger_hits_total{node="node-7",tier="dram"} 5.0' in page
    assert 'yuebing_messenger_hits_total{node="node-7",tier="ssd"} 2.0' in page
    assert 'yuebing_messenger_bytes_in_total{node="node-7"} 1024.0' in page
    assert 'yuebing_messenger_evictions_total{node="node-7"} 6.0' in page
    assert 'yuebing_messenger_ready{node="node-7"} 4.0' in page
    assert 'yuebing_messenger_ssd_blocks{node="node-7"} 3.0' in page
