"""`yuebing bench control-plane --against-vllm` at smoke size: the same clients stream
from the default cluster and from plain `vllm serve` on the same model, and the bench
reads every process's CPU per token from /proc and compares. Not timed: the figures
are the bench's (docs/benchmarks/control-plane.md); this checks that it measures."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import STARTED
from yuebing.bench.control_plane import ControlPlaneBench, comparison_table, measure, total_per_token

pytestmark = pytest.mark.e2e

SMOKE = ControlPlaneBench(streams=2, max_tokens=24, seconds=3.0, warmup_s=1.0, idle_s=0.0, step_ms=0.0,
                          against_vllm=True, rounds=1)


def test_the_bench_compares_every_process_of_the_cluster_with_vllm_s_api_server(cluster, vllm_serve, request):
    model = cluster.config().served_model_name
    ours = asyncio.run(measure([cluster.url], model, cluster.pids, SMOKE))
    served = request.config.stash[STARTED]["vllm_serve"]
    theirs = asyncio.run(measure([vllm_serve.removesuffix("/v1")], model, {"vllm": served.proc.pid}, SMOKE))
    for run in (ours, theirs):
        assert run["errors"] == 0 and run["tokens"] > 0 and run["itl_p99_ms"] > 0
    assert {"gateway", "conductor", "decode", "prefill", "nats", "messenger"} <= set(ours["cpu"])
    assert set(theirs["cpu"]) == {"vllm"} and total_per_token(theirs) > 0
    rows = [{"system": "yuebing", "round": 1, **ours}, {"system": "vllm serve", "round": 1, **theirs}]
    ratio = float(comparison_table(rows).splitlines()[2].rsplit("|", 2)[1])
    assert ratio == pytest.approx(total_per_token(ours) / total_per_token(theirs), abs=0.01)
