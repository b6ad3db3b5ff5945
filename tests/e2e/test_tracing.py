"""One OpenTelemetry trace per request: a cluster with `--otlp-endpoint` sends its
spans to an OTLP/HTTP receiver this test runs, and one disaggregated request yields
one trace with spans from the gateway, the Conductor, prefill and decode, each
parented inside it and in time order."""

from __future__ import annotations

import time

import httpx
import pytest

from yuebing.lab.otlp import Receiver, Span, receiving

DEADLINE_S = 30.0  # each process's exporter sends every 5 s


@pytest.fixture(scope="module")
def traced(launcher, tmp_path_factory):
    with receiving() as receiver:
        launch = launcher(tmp_path_factory.mktemp("traced"), "--nodes", "2", "--otlp-endpoint", receiver.endpoint)
        try:
            yield launch.wait(), receiver
        finally:
            launch.stop()


def trace_of(receiver: Receiver, request_id: str) -> list[Span]:
    """The spans of the trace whose gateway span carries `request_id`, once every
    service's are in."""
    deadline, spans = time.monotonic() + DEADLINE_S, []
    while time.monotonic() < deadline:
        every = receiver.snapshot()
        roots = [s for s in every if s.name == "gateway.request" and s.attributes.get("yuebing.request_id") == request_id]
        spans = [s for s in every if roots and s.trace_id == roots[0].trace_id]
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
