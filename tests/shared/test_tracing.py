"""A trace's context across NATS: into a request's headers, and back out around its
handler; nothing at all while no span records."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared import tracing
from shared.config import ClusterConfig


def test_without_a_recording_span_no_header_is_added_and_none_is_needed():
    assert tracing.headers() is None
    with tracing.continued(None), tracing.continued({"other": "x"}):
        assert not trace.get_current_span().is_recording()
    assert tracing.setup("gateway", "") is None  # no endpoint: nothing set up


def test_an_untraced_span_is_the_shared_non_recording_one_but_a_trace_arriving_still_passes_through():
    # No provider set up in this process, as with no collector configured.
    with tracing.span("conductor.decide", "r1", prompt_tokens=3) as untraced:
        assert untraced is trace.INVALID_SPAN and tracing.headers() is None
    sent = TracerProvider().get_tracer("gateway").start_span("gateway.request")
    with trace.use_span(sent):
        carrier = tracing.headers()
    with tracing.continued(carrier), tracing.span("conductor.decide", "r1") as passing:
        assert passing.get_span_context().trace_id == sent.get_span_context().trace_id
        assert tracing.headers()["traceparent"] == carrier["traceparent"]  # onward to the next process


def test_a_spans_context_crosses_in_the_headers_and_parents_what_the_handler_does():
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("gateway.schedule") as sent:
        carrier = tracing.headers()
    assert carrier and carrier["traceparent"].split("-")[1] == f"{sent.get_span_context().trace_id:032x}"
    with tracing.continued(carrier):
        remote = trace.get_current_span().get_span_context()
        with tracer.start_as_current_span("conductor.decide") as child:
            assert child.parent.span_id == sent.get_span_context().span_id
    assert remote.trace_id == sent.get_span_context().trace_id and remote.is_remote
    assert not trace.get_current_span().get_span_context().is_valid  # detached again


def test_a_request_sampled_out_where_it_starts_is_left_out_by_every_process_after_it():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    gateway = TracerProvider(sampler=ParentBased(ALWAYS_OFF)).get_tracer("gateway")
    conductor = TracerProvider().get_tracer("conductor")  # would record a root of its own
    with gateway.start_as_current_span("gateway.request") as root:
        assert not root.is_recording()
        carrier = tracing.headers()  # the decision travels: the sampled bit clear
    assert carrier and int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0
    with tracing.continued(carrier), conductor.start_as_current_span("conductor.decide") as child:
        assert not child.is_recording()


def test_the_collector_must_be_an_http_url():
    assert ClusterConfig(otlp_endpoint="http://127.0.0.1:4318").otlp_endpoint
    for bad in ("127.0.0.1:4318", "http://x/ y", "file:///etc/passwd"):
        with pytest.raises(ValueError, match="otlp_endpoint"):
            ClusterConfig(otlp_endpoint=bad)
    with pytest.raises(ValueError, match="otlp_sample"):
        ClusterConfig(otlp_sample=1.5)
