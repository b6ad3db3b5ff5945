"""One OpenTelemetry trace per request: a cluster with `--otlp-endpoint` sends its
spans to an OTLP/HTTP receiver this test runs, and one disaggregated request yields
one trace with spans from the gateway, the Conductor, prefill and decode, each
parented inside it and in time order."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from yuebing.process import free_port

DEADLINE_S = 30.0  # each process's exporter sends every 5 s


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP collector that keeps every span it is sent."""

    def __init__(self, port: int) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for scope in rs.scope_spans:
                with self.lock:
                    self.spans += [Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        s.start_time_unix_nano, s.end_time_unix_nano,
                                        {a.key: a.value.string_value or a.value.int_value or a.value.bool_value
                                         for a in s.attributes}) for s in scope.spans]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.add(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def traced(launcher, tmp_path_factory):
    receiver = Receiver(free_port())
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    launch = launcher(tmp_path_factory.mktemp("traced"), "--nodes", "2",
                      "--otlp-endpoint", f"http://127.0.0.1:{receiver.server_address[1]}")
    try:
        yield launch.wait(), receiver
    finally:
        launch.stop()
        receiver.shutdown()


def trace_of(receiver: Receiver, request_id: str) -> list[Span]:
    """The spans of the trace whose gateway span carries `request_id`, once every
    service's are in."""
    deadline, spans = time.monotonic() + DEADLINE_S, []
    while time.monotonic() < deadline:
        with receiver.lock:
            roots = [s for s in receiver.spans if s.name == "gateway.request"
                     and s.attributes.get("yuebing.request_id") == request_id]
            spans = [s for s in receiver.spans if roots and s.trace_id == roots[0].trace_id]
        if {"yuebing-gateway", "yuebing-conductor", "yuebing-prefill", "yuebing-decode"} <= {s.service for s in spans}:
            return spans
        time.sleep(0.5)
    raise AssertionError(f"no whole trace for {request_id}: {spans}")


def test_a_disaggregated_request_is_one_trace_across_the_services_parented_in_time_order(traced):
    cluster, receiver = traced
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
        "model": "yuebing-tiny", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about mooncakes. " * 30}]})
    assert reply.status_code == 200
    spans = trace_of(receiver, reply.headers["x-yuebing-request-id"])
    by_name = {s.name: s for s in spans}
    root = by_name["gateway.request"]
    ids = {s.span_id for s in spans}
    assert root.parent_id == "" and all(s.parent_id in ids for s in spans if s is not root)
    decide, prefill, decode = by_name["conductor.decide"], by_name["prefill"], by_name["decode"]
    assert decide.parent_id == by_name["gateway.schedule"].span_id
    assert prefill.parent_id == by_name["gateway.prefill"].span_id
    assert decode.parent_id == by_name["gateway.decode_start"].span_id
    assert root.start_ns <= decide.start_ns <= prefill.start_ns <= decode.start_ns <= root.end_ns
    assert decide.attributes["yuebing.accepted"] is True and decide.attributes["yuebing.decode"] == "decode-0"
