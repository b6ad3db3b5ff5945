"""The shipped Prometheus rules and Grafana dashboard (compose/observability/) read
metrics our processes declare; a live Prometheus checks them in tests/e2e."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from yuebing.reference import metrics_page

FOLDER = Path(__file__).resolve().parents[2] / "compose" / "observability"
OURS = re.compile(r"\byuebing_[a-z_]+\b")


def exprs() -> list[str]:
    panels = json.loads((FOLDER / "dashboard.json").read_text())["panels"]
    rules = yaml.safe_load((FOLDER / "alerts.yml").read_text())["groups"][0]["rules"]
    return [t["expr"] for p in panels for t in p.get("targets", [])] + [r["expr"] for r in rules]


def test_every_metric_the_dashboard_and_rules_read_is_one_a_process_serves():
    declared = set(re.findall(r"`(yuebing_[a-z_]+)`", metrics_page()))
    # A histogram is read through its _bucket series.
    used = {re.sub(r"_bucket$", "", name) for e in exprs() for name in OURS.findall(e)}
    assert used and used <= declared, used - declared


def test_every_rule_says_how_urgent_it_is_and_what_it_means():
    rules = yaml.safe_load((FOLDER / "alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["labels"]["severity"] for r in rules} <= {"page", "ticket"}
    assert all(r["annotations"]["summary"] for r in rules)
    assert {r["alert"] for r in rules} <= set(re.findall(r"`(Yuebing\w+)`", (FOLDER.parents[1] / "docs" /
                                                                             "operations.md").read_text()))


def test_the_dashboards_panels_have_unique_ids_and_queries():
    panels = json.loads((FOLDER / "dashboard.json").read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert all(t["expr"] for p in panels if p["type"] != "row" for t in p["targets"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_accepts_the_rules_and_the_configuration():
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run(["promtool", *args], cwd=FOLDER, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
