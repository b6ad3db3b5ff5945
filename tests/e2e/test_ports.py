"""A port taken between the launcher's draw and its child's bind (the collision a
random draw can meet): the child fails to bind, starts again on a free port, and the
cluster comes up whole. A real `yuebing up` cluster in-process, on fake engines (the
ports, not the engines, are under test), with another program taking the Conductor's
metrics port right after the launcher planned it."""

from __future__ import annotations

import socket

import httpx
import pytest

from shared.config import ClusterConfig
from tests.e2e.ops import eventually
from tests.suite_report import suite_report
from yuebing.launcher import Cluster, UpOptions
from yuebing.process import free_ports

pytestmark = pytest.mark.e2e


class Thief(Cluster):
    """A cluster whose Conductor's metrics port another program binds once it is drawn."""

    def plan(self, run_dir, config_path, secrets) -> None:
        super().plan(run_dir, config_path, secrets)
        conductor = next(c for c in self.children if c.name == "conductor")
        self.taken = int(conductor.argv[conductor.argv.index("--metrics-port") + 1])
        self.thief = socket.socket()
        self.thief.bind(("127.0.0.1", self.taken))
        self.thief.listen()


def test_a_child_whose_port_was_taken_before_it_bound_comes_up_on_another(model_dir, tmp_path, capsys, request):
    config = ClusterConfig(model=str(model_dir), fake_engine_step_ms=5)
    cluster = Thief(UpOptions(config=config, port=free_ports(1), run_dir=tmp_path / "run",
                              ready_file=tmp_path / "ready.json", start_timeout_s=180))
    try:
        seconds = cluster.start()
        report = suite_report(request.config)
        report.started("ports", cluster.options.layout() + " (fake engines, in pytest)", 0, seconds, cluster)
        report.used(request.node.nodeid.split("::", 1)[0], [cluster])  # no fixture hands it to the test
        conductor = next(c for c in cluster.children if c.name == "conductor")
        port = int(conductor.argv[conductor.argv.index("--metrics-port") + 1])
        assert conductor.restarts >= 1 and port != cluster.taken and not conductor.failed
        eventually(lambda: _page(cluster.metrics["conductor"]), lambda page: page is not None and "yuebing" in page,
                   "the Conductor's page on its new port", timeout_s=30)
        assert f"conductor's metrics port {cluster.taken} is taken" in capsys.readouterr().err
    finally:
        cluster.stop()
        cluster.thief.close()


def _page(url: str) -> str | None:
    try:
        r = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None
