"""The span of a request's push to another node: opened by the reservation that
carries its trace, ended by its release, and never left open for good."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.messenger.pushes import MAX_OPEN_S, Pushes
from shared.kv.wire import Reserve

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr("shared.tracing.tracer", lambda: provider.get_tracer("test"))
    return exporter


def reserve(owner: str, trace_headers: dict[str, str], dest: str = "node-1") -> Reserve:
    return Reserve(owner=owner, hashes=[b"h" * 16], dest=dest, trace=trace_headers)


def test_a_push_is_one_span_in_the_requests_trace_from_reservation_to_release(spans):
    pushes = Pushes("node-0")
    pushes.reserved(reserve("r1", {"traceparent": PARENT}), now=0.0)
    pushes.reserved(reserve("r1", {}), now=0.1)  # its later chunks carry no context: the same push
    assert spans.get_finished_spans() == ()
    pushes.released("r1")
    (span,) = spans.get_finished_spans()
    assert span.name == "messenger.push" and format(span.context.trace_id, "032x") == PARENT.split("-")[1]
    assert format(span.parent.span_id, "016x") == PARENT.split("-")[2]
    assert span.attributes["to_node"] == "node-1" and span.attributes["yuebing.request_id"] == "r1"


def test_no_trace_or_no_destination_opens_nothing(spans):
    pushes = Pushes("node-0")
    pushes.reserved(reserve("r1", {}), now=0.0)
    pushes.reserved(reserve("r2", {"traceparent": PARENT}, dest=""), now=0.0)
    pushes.reserved(reserve("r3", {"traceparent": PARENT}, dest="node-0"), now=0.0)
    assert not pushes.open


def test_a_push_never_released_ends_when_it_is_too_old(spans):
    pushes = Pushes("node-0")
    pushes.reserved(reserve("r1", {"traceparent": PARENT}), now=0.0)
    pushes.expire(now=MAX_OPEN_S + 1)
    (span,) = spans.get_finished_spans()
    assert span.attributes["yuebing.ended"] == "never released" and not pushes.open
