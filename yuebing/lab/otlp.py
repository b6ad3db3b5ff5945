"""An OTLP/HTTP trace receiver: what a collector does with a cluster's spans, kept in
memory (the tracing test reads them) or only counted (`yuebing bench goodput`'s
`traced` setup, which measures what tracing costs without a collector's own)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from yuebing.process import free_port


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
    """Answers every export with 200; keeps the spans when `keep`, else counts them."""

    daemon_threads = True

    def __init__(self, port: int, keep: bool = True) -> None:
        self.keep, self.count, self.spans = keep, 0, []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def add(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest.FromString(body)
        spans = [_span(rs, s) for rs in request.resource_spans for scope in rs.scope_spans for s in scope.spans]
        with self.lock:
            self.count += len(spans)
            if self.keep:
                self.spans += spans

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


def _span(resource_spans, s) -> Span:
    service = next((a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "")
    attributes = {a.key: _value(a.value) for a in s.attributes}
    return Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.start_time_unix_nano,
                s.end_time_unix_nano, attributes)


def _value(value):
    """An attribute's value, whichever of OTLP's scalar kinds it is."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "int_value", "bool_value", "double_value") else None


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.add(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # its requests are not this process's news
        pass


@contextmanager
def receiving(keep: bool = True) -> Iterator[Receiver]:
    """A receiver serving on a free port until the block ends."""
    receiver = Receiver(free_port(), keep)
    thread = threading.Thread(target=receiver.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.shutdown()
        receiver.server_close()
