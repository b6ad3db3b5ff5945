"""The gateway's HTTP hygiene and shedding over real sockets (issue 16): slow
headers and bodies, idle keep-alive, a client that stops reading a stream, the
connection cap, the bounded queue with its 429s, SLO headers that may only tighten,
and NATS errors answered as 503s. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import socket
import time

import nats.errors
import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from services.gateway.app import slo_from_headers
from services.gateway.limits import Admission, Shed
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import LagMonitor
from services.gateway.text import Tokenizer
from shared.config import ClusterConfig
from shared.liveness import Deafness, Registry
from shared.messages import Heartbeat
from tests.gateway.served import (
    MODEL,
    EndlessPipeline,
    Served,
    closed_within,
    read_reply,
    request_bytes,
    wait_until,
)

pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model (make test writes it)")
FAST = {"gateway_header_timeout_s": 0.5, "gateway_body_timeout_s": 0.5, "gateway_keepalive_timeout_s": 1.0,
        "gateway_write_timeout_s": 0.5}
COMPLETION = {"model": "yuebing-tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(str(MODEL))


@pytest.fixture
def serve(tokenizer):
    started: list[Served] = []

    def start(**settings) -> Served:
        config = ClusterConfig(model=str(MODEL), max_model_len=512, **settings)
        started.append(Served(config, EndlessPipeline(), tokenizer))
        return started[-1]

    yield start
    for s in started:
        s.close()


def post(served: Served, body: dict, **headers) -> bytes:
    return request_bytes("/v1/completions", orjson.dumps(body), headers)


def test_headers_that_trickle_in_are_cut_at_the_header_timeout(serve):
    served = serve(**FAST)
    s = served.connect()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    s.settimeout(0.1)
    start, data = time.monotonic(), b""
    while time.monotonic() - start < 5:  # a header byte every 0.1 s, never the end of the headers
        try:
            s.sendall(b"x")
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 ") and b'"code":"header_timeout"' in data
    assert elapsed < 0.5 + 1.0, elapsed
    assert served.metric('yuebing_gateway_http_timeouts_total{phase="header"}') == 1


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(serve):
    served = serve(**FAST)
    data, elapsed = closed_within(served.connect(), 5)
    assert data.startswith(b"HTTP/1.1 408 ") and elapsed < 1.5, (data, elapsed)


def test_a_body_that_trickles_in_is_a_408_within_the_body_timeout(serve):
    served = serve(**FAST)
    s = served.connect()
    whole = post(served, COMPLETION)
    s.sendall(whole[: len(whole) - 10])  # the headers and most of the body; the rest never comes
    start = time.monotonic()
    status, _, body = read_reply(s)
    assert status == 408 and orjson.loads(body)["error"]["code"] == "body_timeout"
    assert time.monotonic() - start < 0.5 + 1.0
    _, elapsed = closed_within(s, 5)  # drained for a little while, then closed
    assert elapsed < 3.0
    assert served.metric('yuebing_gateway_http_timeouts_total{phase="body"}') == 1


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(serve):
    served = serve(**FAST)
    s = served.connect()
    s.sendall(post(served, COMPLETION))
    assert read_reply(s)[0] == 200
    data, elapsed = closed_within(s, 5)
    assert data == b"" and 0.7 < elapsed < 2.0, elapsed  # the keep-alive timeout (1 s), not the header one


def test_a_client_that_stops_reading_a_stream_is_cut_and_its_request_cancelled(serve):
    served = serve(**FAST)
    served.pipeline.endless = True
    s = served.connect(rcvbuf=4096)
    # Small buffers on the server's side too, so that a few hundred KiB fill them
    # (autotuned, they would take MiBs: seconds of streaming on a loaded box).
    wait_until(lambda: served.metric("yuebing_gateway_http_connections") == 1, 5, "the connection accepted")
    served.call(_shrink_send_buffers(served))
    s.sendall(post(served, {**COMPLETION, "stream": True}))  # and never read a byte
    served.pipeline.started.wait(10)
    # The buffers between us fill, the next write waits 0.5 s, then the request is
    # cancelled upstream (the pipeline's generator closed) and the connection dropped.
    assert served.pipeline.closed.wait(30), "the pipeline was never closed"
    wait_until(lambda: served.metric('yuebing_gateway_http_timeouts_total{phase="write"}') == 1, 5, "write timeout counted")
    # Counted in the handler's `finally`, a moment after the timeout: wait for it too.
    wait_until(lambda: served.metric('yuebing_gateway_requests_total{endpoint="completion",status="499"}') == 1,
               5, "the request counted as a 499")
    assert served.gateway.admission.running == 0


async def _shrink_send_buffers(served: Served) -> None:
    for handler in served.runner.server.connections:
        handler.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def test_connections_beyond_the_cap_are_a_503_and_closed(serve):
    served = serve(gateway_max_connections=3)
    held = [served.connect() for _ in range(3)]
    wait_until(lambda: served.metric("yuebing_gateway_http_connections") == 3, 5, "three connections open")
    status, headers, body = read_reply(served.connect())
    assert status == 503 and headers["retry-after"] == "1"
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"
    assert served.metric("yuebing_gateway_http_connections_refused_total") == 1
    held.pop().close()
    wait_until(lambda: served.metric("yuebing_gateway_http_connections") == 2, 5, "a connection closed")
    s = served.connect()
    s.sendall(post(served, COMPLETION))
    assert read_reply(s)[0] == 200


def test_beyond_running_and_waiting_requests_are_shed_with_429(serve):
    served = serve(gateway_max_running=1, gateway_max_waiting=1, gateway_queue_timeout_s=0.5)
    served.pipeline.gate = served.call(_event())
    first, queued, shed = served.connect(), served.connect(), served.connect()
    first.sendall(post(served, COMPLETION))
    served.pipeline.started.wait(10)
    queued.sendall(post(served, COMPLETION))
    wait_until(lambda: served.gateway.admission.waiting == 1, 5, "one request queued")
    shed.sendall(post(served, COMPLETION))
    status, headers, body = read_reply(shed)  # at once: the queue is full
    assert status == 429 and headers["retry-after"] == "1" and orjson.loads(body)["error"]["code"] == "overloaded"
    status, _, _ = read_reply(queued)  # after its 0.5 s in the queue
    assert status == 429
    served.loop.call_soon_threadsafe(served.pipeline.gate.set)
    assert read_reply(first)[0] == 200
    assert served.metric('yuebing_gateway_shed_total{reason="queue_full"}') == 1
    assert served.metric('yuebing_gateway_shed_total{reason="queue_timeout"}') == 1


async def _event() -> asyncio.Event:
    return asyncio.Event()


async def test_admission_hands_slots_on_in_order_and_sheds_the_rest():
    admission = Admission(max_running=1, max_waiting=1, queue_timeout_s=5)
    order: list[str] = []

    async def serve(name: str, hold: asyncio.Event) -> None:
        async with admission.slot():
            order.append(name)
            await hold.wait()

    a_hold, b_hold = asyncio.Event(), asyncio.Event()
    a = asyncio.create_task(serve("a", a_hold))
    await asyncio.sleep(0)
    b = asyncio.create_task(serve("b", b_hold))
    async with asyncio.timeout(5):
        while admission.waiting < 1:
            await asyncio.sleep(0)
    with pytest.raises(Shed) as shed:
        await serve("c", asyncio.Event())
    assert shed.value.reason == "queue_full" and shed.value.api_error().status == 429
    a_hold.set()
    b_hold.set()
    async with asyncio.timeout(5):
        await asyncio.gather(a, b)
    assert order == ["a", "b"] and (admission.running, admission.waiting) == (0, 0)


async def test_the_queue_hands_slots_on_by_priority_then_arrival_and_a_waiter_that_leaves_takes_nothing():
    admission = Admission(max_running=1, max_waiting=8, queue_timeout_s=5)
    order: list[str] = []
    hold = asyncio.Event()

    async def serve(name: str, priority: int) -> None:
        async with admission.slot(priority):
            order.append(name)
            await hold.wait()

    first = asyncio.create_task(serve("first", 0))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(serve(name, p)) for name, p in (("late", 5), ("a", 0), ("urgent", -1), ("b", 0))]
    gone = asyncio.create_task(serve("gone", -9))
    async with asyncio.timeout(5):
        while admission.waiting < 5:
            await asyncio.sleep(0)
    gone.cancel()  # a client that went away while queued
    hold.set()
    async with asyncio.timeout(5):
        await asyncio.gather(first, *waiters)
    assert order == ["first", "urgent", "a", "b", "late"]
    assert (admission.running, admission.waiting) == (0, 0)


async def test_a_queued_request_past_its_wait_is_shed_and_leaves_its_place():
    admission = Admission(max_running=1, max_waiting=2, queue_timeout_s=0.05)
    async with admission.slot():
        with pytest.raises(Shed) as shed:
            async with admission.slot(3):
                pass
        assert shed.value.reason == "queue_timeout" and admission.waiting == 0
    assert admission.running == 0


def test_slo_headers_may_only_tighten_the_clusters():
    config = ClusterConfig(model="/m/tiny", slo_ttft_ms=2000.0, slo_tbt_ms=100.0)
    clamped: list[int] = []
    looser = make_mocked_request("POST", "/", headers={"x-yuebing-slo-ttft-ms": "60000", "x-yuebing-slo-tbt-ms": "500"})
    slo = slo_from_headers(looser, config, lambda: clamped.append(1))
    assert (slo.ttft_ms, slo.tbt_ms, len(clamped)) == (2000.0, 100.0, 2)
    tighter = make_mocked_request("POST", "/", headers={"x-yuebing-slo-ttft-ms": "500", "x-yuebing-slo-tbt-ms": "50"})
    assert slo_from_headers(tighter, config) == type(slo)(ttft_ms=500.0, tbt_ms=50.0)
    unknown = ClusterConfig(model="/m/tiny", slo_ttft_ms=0.0, slo_tbt_ms=0.0)  # derived at start, not yet here
    assert slo_from_headers(looser, unknown) == type(slo)(ttft_ms=60000.0, tbt_ms=500.0)


@pytest.mark.parametrize("error", [nats.errors.ConnectionClosedError(), nats.errors.OutboundBufferLimitError(),
                                   nats.errors.ConnectionReconnectingError()])
@pytest.mark.parametrize("stream", [False, True])
def test_a_nats_error_is_a_503_never_a_500(serve, error, stream):
    served = serve()
    served.pipeline.fail = error
    s = served.connect()
    s.sendall(post(served, {**COMPLETION, "stream": stream}))
    status, headers, body = read_reply(s)
    assert status == 503 and headers["retry-after"] == "1"
    assert orjson.loads(body)["error"] == {
        "message": f"cluster unreachable: the gateway's message bus failed ({type(error).__name__}); retry shortly",
        "type": "server_error", "param": None, "code": "bus_unavailable"}
    assert served.metric(f'yuebing_gateway_nats_errors_total{{error="{type(error).__name__}"}}') == 1


async def test_the_lag_monitor_sees_a_stall_and_counts_it():
    metrics = GatewayMetrics()
    monitor = LagMonitor(metrics, interval_s=0.01)
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.03)
    time.sleep(0.15)  # noqa: ASYNC251 - on purpose: a step that holds the loop
    async with asyncio.timeout(5):
        while monitor.max_lag_s < 0.1:
            await asyncio.sleep(0.01)
    task.cancel()
    assert b'yuebing_gateway_loop_lag_seconds_bucket{le="0.1"}' in metrics.render()


async def test_the_lag_monitor_s_ticks_are_the_registry_s_listens_so_a_stall_is_no_instance_s_silence():
    registry = Registry(timeout_s=0.1, deafness=Deafness(tick_s=0.01, grace_s=0.05))
    registry.observe(Heartbeat(instance_id="d0", role="decode", node="n", pid=1, seq=1, sent_at=0.0), time.monotonic())
    task = asyncio.create_task(LagMonitor(GatewayMetrics(), interval_s=0.01, on_tick=registry.heard).run())
    await asyncio.sleep(0.03)
    time.sleep(0.3)  # noqa: ASYNC251 - a stall, three liveness timeouts long, d0's heartbeats unread
    await asyncio.sleep(0.02)  # the monitor's first tick after it
    task.cancel()
    assert registry.is_alive("d0", time.monotonic())
