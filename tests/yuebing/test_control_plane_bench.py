"""`yuebing bench control-plane`'s arithmetic: the window's requests, tokens and gaps,
and CPU per request and per token by role. (The bench itself runs live clusters:
tests/e2e/test_control_plane.py runs it against vllm serve at smoke size, and
tests/e2e/test_ports.py starts a cluster of fake engines.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from yuebing.bench.control_plane import (
    Clients,
    ControlPlaneBench,
    Stream,
    cluster_flags,
    conductor_counts,
    cpu_costs,
    cpu_s,
    idle_cores,
    per_token,
    role_of,
    table,
    window,
)
from yuebing.bench import engine_alone


def test_the_window_counts_requests_ended_and_tokens_received_inside_it():
    inside = Stream(started=1.0, ended=2.0, token_times=[1.5, 1.6, 1.8, 2.0], ok=True)
    before = Stream(started=0.0, ended=0.9, token_times=[0.5, 0.9], ok=True)
    straddling = Stream(started=2.5, ended=12.0, token_times=[3.0, 11.0], ok=True)
    w = window([inside, before, straddling], start=1.0, end=11.0)
    assert w["requests"] == 1 and w["tokens"] == 5 and w["requests_per_s"] == pytest.approx(0.1)
    assert w["itl_p50_ms"] == pytest.approx(200.0)  # gaps after the first token's: 0.2 and 0.2
    assert w["ttft_p50_ms"] == pytest.approx(500.0)


def test_cpu_is_summed_by_role_per_request_and_per_token():
    before = {"gateway": 1.0, "gateway-1": 2.0, "conductor": 0.0, "nats": 0.0}
    after = {"gateway": 1.5, "gateway-1": 2.5, "conductor": 0.2, "nats": 0.1}
    costs = cpu_costs(before, after, requests=100, tokens=10_000)
    assert costs["gateway"]["us_per_token"] == pytest.approx(100.0) and costs["gateway"]["processes"] == 2
    assert costs["conductor"]["us_per_request"] == pytest.approx(2000.0)
    assert costs["gateway"]["busiest_s"] == pytest.approx(0.5)
    assert [role_of(n) for n in ("gateway-1", "decode-0", "nats")] == ["gateway", "decode", "nats"]


def test_over_idle_takes_each_role_s_idle_cpu_over_the_window_off_its_figure_per_token():
    before = {"decode-0": 0.0, "decode-1": 0.0, "gateway": 0.0}
    after = {"decode-0": 0.6, "decode-1": 0.4, "gateway": 0.1}
    idle = {"decode-0": 0.01, "decode-1": 0.01, "gateway": 0.02}  # cores: 0.2 s of decode's 1.0 over 10 s
    costs = cpu_costs(before, after, requests=10, tokens=1_000, idle=idle, seconds=10.0)
    assert costs["decode"]["us_per_token"] == pytest.approx(1000.0)
    assert costs["decode"]["us_per_token_over_idle"] == pytest.approx(800.0)
    assert costs["decode"]["idle_cores"] == pytest.approx(0.02)
    assert costs["gateway"]["us_per_token_over_idle"] == 0.0  # busier idle than loaded reads as nothing, not below
    assert "us_per_token_over_idle" not in cpu_costs(before, after, requests=10, tokens=1_000)["decode"]


async def test_the_idle_window_reads_each_process_s_cpu_in_cores():
    idle = await idle_cores({"me": os.getpid()}, 0.05)
    assert idle is not None and 0 <= idle["me"] < 2
    assert await idle_cores({"me": os.getpid()}, 0) is None


def test_the_table_shows_over_idle_beside_each_figure_where_measured():
    assert per_token({"us_per_token": 111.4, "us_per_token_over_idle": 95.2}) == "111 (95)"
    assert per_token({"us_per_token": 111.4}) == "111"


def test_cpu_time_is_read_from_proc():
    assert cpu_s(os.getpid()) > 0


def test_settings_are_checked():
    with pytest.raises(ValueError):
        ControlPlaneBench(gateways=(0,))
    with pytest.raises(ValueError):
        ControlPlaneBench(step_ms=-1)
    with pytest.raises(ValueError):
        ControlPlaneBench(idle_s=-1)
    with pytest.raises(ValueError):
        ControlPlaneBench(rate_per_conductor=-1)


class SlowSession:
    """An HTTP session whose every completion holds its stream `hold_s` and streams one
    token: the arrival schedule alone, without a cluster."""

    hold_s = 0.25

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    @contextlib.asynccontextmanager
    async def post(self, url: str, json: Any) -> AsyncIterator[Any]:
        self.bodies.append(json)
        await asyncio.sleep(self.hold_s)
        yield SimpleNamespace(status=200, content=lines_of([b'data: {"choices": []}\n']))


async def lines_of(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


def test_an_open_loop_starts_requests_on_schedule_and_sheds_what_finds_every_stream_busy():
    clients = Clients(["http://unused"], "m", ControlPlaneBench(streams=2), rate=20.0)
    asyncio.run(clients._arrivals(SlowSession(), until=time.monotonic() + 0.5))
    # 10 arrivals, 50 ms apart; each request holds a stream 250 ms, and 2 streams hold
    # the first two until the sixth arrival: 2 run, 3 shed, and so on.
    assert len(clients.done) + clients.shed == 10
    assert 3 <= len(clients.done) <= 5 and clients.shed >= 5
    assert clients.errors == 0 and clients.in_flight == 0 and all(len(s.token_times) == 1 for s in clients.done)


def test_every_stream_asks_for_max_tokens_whatever_the_model_would_end_on():
    session, clients = SlowSession(), Clients(["http://unused"], "m", ControlPlaneBench(max_tokens=64))
    asyncio.run(clients._one(session, 0))
    assert session.bodies[0]["max_tokens"] == 64 and session.bodies[0]["ignore_eos"] is True


def test_a_step_of_zero_runs_real_engines_under_slos_the_streams_do_not_break():
    flags = cluster_flags(ControlPlaneBench(step_ms=0, decode=1), 1, 1)
    assert "--fake-engine-step-ms" not in flags and flags[flags.index("--decode") + 1] == "1"
    assert float(flags[flags.index("--slo-tbt-ms") + 1]) >= 1000  # admission's 429s would be what it measures
    fake = cluster_flags(ControlPlaneBench(), 1, 1)
    assert "--fake-engine-step-ms" in fake and "--slo-tbt-ms" not in fake


def test_the_conductors_sync_interval_is_the_cluster_s_unless_asked():
    assert "--conductor-sync-ms" not in cluster_flags(ControlPlaneBench(), 1, 2)
    flags = cluster_flags(ControlPlaneBench(conductor_sync_ms=20), 1, 2)
    assert flags[flags.index("--conductor-sync-ms") + 1] == "20"


def test_with_real_engines_the_table_says_what_vllm_alone_costs():
    costs = {role: {"us_per_token": 1.0, "us_per_request": 1.0} for role in ("gateway", "decode", "nats", "conductor",
                                                                            "prefill")}
    result = {"gateways": 1, "conductors": 1, "requests_per_s": 1.0, "tokens_per_s": 9.0, "itl_p50_ms": 1.0,
              "itl_p99_ms": 2.0, "cpu": costs, "conductor_decisions_per_core_s": 5.0, "errors": 0, "shed": 0}
    assert "vLLM" not in table([result])
    alone = table([{**result, "vllm_alone": {"tokens_per_s": 1000.0, "us_per_token": 84.2}}])
    assert "vLLM's AsyncLLM alone" in alone and "84 µs/token" in alone and "engine-core" not in alone
    both = table([{**result, "vllm_alone": {"tokens_per_s": 1000.0, "us_per_token": 84.2},
                   "core_alone": {"tokens_per_s": 1000.0, "us_per_token": 41.0}}])
    assert "engine-core client alone" in both and "41 µs/token" in both


def test_the_engine_alone_says_why_it_failed(tmp_path):
    with pytest.raises(RuntimeError, match="engine alone failed"):
        engine_alone.run(tmp_path / "missing.json", streams=1, max_tokens=2, warmup_s=0.0, seconds=0.1)


def test_decode_refusals_and_placements_are_summed_over_the_conductors_metrics_pages():
    import http.server
    import threading

    from prometheus_client import generate_latest

    from services.conductor.app import Conductor
    from services.conductor.metrics import ConductorMetrics
    from shared.config import ClusterConfig

    pages = {}
    for name, accepted, wasted in (("conductor", 7, 1), ("conductor-1", 5, 2)):
        c = Conductor(ClusterConfig(model="/m/tiny", conductors=2), name)
        c.counts.update(accepted=accepted, wasted_prefill=wasted)
        pages[f"/{name}"] = generate_latest(ConductorMetrics(c).registry)
    pages["/gateway"] = b"yuebing_conductor_wasted_prefills_total 100.0\n"  # not a Conductor's: not counted

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(pages[self.path])

        def log_message(self, *_args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        counts = conductor_counts({name: f"{base}/{name}" for name in ("conductor", "conductor-1", "gateway")})
    finally:
        server.shutdown()
    assert counts == {"accepted": 12, "decode_refusals": 3}


def a_run(system: str, round_: int, **per_token: float) -> dict[str, Any]:
    return {"system": system, "round": round_, "tokens_per_s": 100.0, "itl_p50_ms": 20.0, "itl_p99_ms": 40.0,
            "errors": 0, "cpu": {role: {"us_per_token": us} for role, us in per_token.items()}}


def test_against_vllm_sums_every_process_and_divides_by_vllm_s_api_server_round_by_round():
    from yuebing.bench.control_plane import comparison_line, comparison_table, total_per_token

    rows = [a_run("yuebing", 1, gateway=200, decode=250, nats=50), a_run("vllm serve", 1, vllm=400),
            a_run("yuebing", 2, gateway=150, decode=150, nats=50), a_run("vllm serve", 2, vllm=350)]
    assert total_per_token(rows[0]) == 500
    lines = comparison_table(rows).splitlines()
    assert lines[0].startswith("| round | system |") and "decode µs/token | gateway µs/token | nats" in lines[0]
    assert lines[2].endswith("| 500 | 1.25 |") and lines[3].endswith("| — | — | — | 400 | 1.00 |")
    assert lines[4].endswith("| 350 | 1.00 |")
    assert comparison_line(rows[1]).startswith("vllm serve (round 1): 400 µs/token (vllm 400)")


def test_the_floor_is_decode_s_engine_core_client_vllm_s_server_over_its_engine_and_the_rest_as_measured():
    from yuebing.bench.control_plane import floor, floor_line

    rows = [a_run("yuebing", 1, gateway=100, decode=120, nats=10, conductor=20), a_run("vllm serve", 1, vllm=180),
            a_run("yuebing", 2, gateway=90, decode=110, nats=6, conductor=14), a_run("vllm serve", 2, vllm=160)]
    assert floor(rows) is None  # no engine-alone figures: no floor
    for r in rows[::2]:
        r["vllm_alone"], r["core_alone"] = {"us_per_token": 90.0}, {"us_per_token": 60.0}
    least = floor(rows)
    # 60 (the client) + (170 - 90) (vLLM's server over its AsyncLLM) + 25 (the rest, mean of 30 and 20)
    assert least == {"core_client": 60.0, "server_over_asyncllm": 80.0, "others": 25.0, "total": 165.0,
                     "vllm": 170.0, "ratio": 165.0 / 170.0}
    assert floor_line(least).endswith("= 165 µs/token, 0.97× vLLM's API server (170)")


def test_against_vllm_runs_real_engines():
    with pytest.raises(ValueError):
        ControlPlaneBench(against_vllm=True)  # the fake engine's step: nothing of vLLM's to compare
    with pytest.raises(ValueError):
        ControlPlaneBench(against_vllm=True, step_ms=0, rounds=0)
    assert ControlPlaneBench(against_vllm=True, step_ms=0).rounds == 2
    with pytest.raises(ValueError):
        ControlPlaneBench(floor=True, step_ms=0)  # a part of --against-vllm
