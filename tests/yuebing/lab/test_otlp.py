"""The OTLP/HTTP receiver the tracing test and the goodput bench use: an exporter's
spans arrive, kept or counted."""

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from yuebing.lab.otlp import receiving


def test_an_exporters_spans_arrive_with_their_service_parent_and_attributes():
    for keep in (True, False):
        with receiving(keep) as receiver:
            provider = TracerProvider(resource=Resource.create({"service.name": "yuebing-test"}))
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
            tracer = provider.get_tracer("test")
            with tracer.start_as_current_span("outer", attributes={"yuebing.request_id": "r1"}) as outer:
                with tracer.start_as_current_span("inner"):
                    pass
            provider.shutdown()
            assert receiver.count == 2
            spans = {s.name: s for s in receiver.snapshot()}
        if keep:
            assert spans["inner"].parent_id == f"{outer.get_span_context().span_id:016x}"
            assert spans["outer"].service == "yuebing-test" and spans["outer"].attributes["yuebing.request_id"] == "r1"
        else:
            assert spans == {}
