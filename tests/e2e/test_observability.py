"""A real Prometheus (Debian's package) scrapes every process of a live two-node
cluster under load, with the shipped alert rules loaded: every query the dashboard
and the rules use returns data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from yuebing.process import free_port

OBSERVABILITY = Path(__file__).resolve().parents[2] / "compose" / "observability"
DEADLINE_S = 60.0
# A metric a rule reads: ours, vLLM's, or Prometheus' own.
METRIC = re.compile(r"\b(yuebing_[a-z_]+|vllm:[a-z_:]+|process_start_time_seconds|up)\b")

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("prometheus") is None,
                                                 reason="Debian's prometheus package is not installed (make test "
                                                        "installs it as root)")]


def dashboard_queries() -> list[str]:
    panels = json.loads((OBSERVABILITY / "dashboard.json").read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_metrics() -> set[str]:
    rules = yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())["groups"][0]["rules"]
    return {name for r in rules for name in METRIC.findall(r["expr"])}


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    targets = [urlparse(url).netloc for url in cluster.metrics.values()]
    shutil.copy(OBSERVABILITY / "alerts.yml", folder / "alerts.yml")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["alerts.yml"],
              "scrape_configs": [{"job_name": "yuebing", "static_configs": [{"targets": targets}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (folder / "prometheus.log").open("w")
    proc = subprocess.Popen(["prometheus", f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", len(targets)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def query(base: str, expr: str) -> list:
    reply = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def eventually(base: str, expr: str, ok) -> list:
    """The query's result once `ok` holds of it (a scrape or two may be needed)."""
    deadline, result = time.monotonic() + DEADLINE_S, []
    while time.monotonic() < deadline:
        try:
            result = query(base, expr)
        except (httpx.HTTPError, ValueError):  # still starting: no answer, or not JSON yet
            result = []
        if ok(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{expr}: {result}")


def load(client, n: int = 4) -> None:
    for i in range(n):
        client.chat.completions.create(model="yuebing-tiny", messages=[{"role": "user", "content": f"Count to {i}"}],
                                       temperature=0, max_tokens=8)


def test_prometheus_scrapes_every_process_and_every_dashboard_and_rule_query_has_data(prometheus, client):
    base, targets = prometheus
    up = eventually(base, 'up{job="yuebing"} == 1', lambda r: len(r) == targets)
    assert len(up) == targets >= 6  # gateway, Conductor, two messengers, prefill and decode
    load(client)
    # A scrape of every process after the first load, then more load: rates need two
    # samples with traffic between them (the queries below wait for the next scrape).
    loaded_at = time.time()
    eventually(base, 'min(timestamp(up{job="yuebing"}))', lambda r: bool(r) and float(r[0]["value"][1]) > loaded_at)
    load(client)
    for expr in dashboard_queries():
        eventually(base, expr, bool)
    for name in sorted(rule_metrics()):
        eventually(base, f'count({{__name__="{name}"}})', bool)
    rules = httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"][0]["rules"]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules
