"""One OpenTelemetry trace per request across the five services. Each process exports
its spans over OTLP/HTTP when the cluster names a collector (`otlp_endpoint`); the
trace's context crosses NATS in each message's headers (W3C `traceparent`), so the
Conductor's decision, prefill, the messengers' pulls and decode are children of the
gateway's span for the request.

With no endpoint nothing is set up: OpenTelemetry's API then hands out non-recording
spans, and no header is added to any message (tracing off costs nothing measurable)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager as ContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context, propagate, trace

TRACER = "yuebing"


def setup(service: str, endpoint: str, sample: float = 1.0) -> Any:
    """Export this process's spans to `endpoint` (an OTLP/HTTP collector's base URL),
    tracing a `sample` share of requests (decided where a trace starts, at the
    gateway, and followed by every process after it); the provider, to shut down
    (flushing what is queued) on exit, or None."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({"service.name": f"yuebing-{service}"}),
                              sampler=ParentBased(TraceIdRatioBased(sample)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5)))
    trace.set_tracer_provider(provider)
    return provider


def traces_url(endpoint: str) -> str:
    """Where an OTLP/HTTP collector at `endpoint` takes spans."""
    return f"{endpoint.rstrip('/')}/v1/traces"


# vLLM's own tracing (its `llm_request` span: queue, prefill and decode times, tokens)
# speaks OTLP over gRPC unless its environment says otherwise; ours is OTLP/HTTP.
ENGINE_ENVIRONMENT = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def headers() -> dict[str, str] | None:
    """The current trace context as message headers: a sampled-out one too, so that
    the processes after it leave the request out as well (None outside any trace)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


@contextmanager
def continued(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block in the trace context a message's headers carry (none: as it is)."""
    if not carrier or "traceparent" not in carrier:
        yield
        return
    token = context.attach(propagate.extract(dict(carrier)))
    try:
        yield
    finally:
        context.detach(token)


def started(name: str, request_id: str, carrier: Mapping[str, str], **attributes: Any) -> trace.Span | None:
    """A span of the trace `carrier` names, begun now and ended by the caller (one
    that outlives any call: a push from its first reservation to its release); None
    without a trace."""
    if "traceparent" not in carrier:
        return None
    return tracer().start_span(name, context=propagate.extract(dict(carrier)),
                               attributes={"yuebing.request_id": request_id, **attributes})


def span(name: str, request_id: str, **attributes: Any) -> ContextManager[trace.Span]:
    """A span of this request's trace, with its id (and `attributes`) on it."""
    if not _tracing():
        return _NO_SPAN
    return _span(name, request_id, attributes)


@contextmanager
def _span(name: str, request_id: str, attributes: dict[str, Any]) -> Iterator[trace.Span]:
    with tracer().start_as_current_span(name, attributes={"yuebing.request_id": request_id, **attributes}) as s:
        yield s


def _tracing() -> bool:
    """Whether a span could record or carry anything: this process exports spans, or
    it runs inside a trace that came with a message. Else OpenTelemetry's own
    non-recording span would cost about 10 µs of context managers, for nothing."""
    return (not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
            or trace.get_current_span().get_span_context().is_valid)


# Entered and left by every untraced span: it holds no state.
_NO_SPAN: ContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)
