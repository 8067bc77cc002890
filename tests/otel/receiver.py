"""A minimal OTLP/HTTP trace receiver for the CLI tests: it decodes each request with
OpenTelemetry's own protobuf classes and keeps the spans and the headers it was sent.

It stands in for a viewer where the test is about the command (arguments, headers, a kill and
a restart), not about what a viewer shows; `test_phoenix.py` exports into a real one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    name: str
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    raw: bytes  # the span's protobuf encoding: two sends of one span compare equal


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def roots(self) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if not s.parent_span_id]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver on a free port of 127.0.0.1 for the block."""
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            with receiver.lock:
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            receiver.spans.append(
                                ReceivedSpan(
                                    span.trace_id,
                                    span.span_id,
                                    span.parent_span_id,
                                    span.name,
                                    {a.key: _value(a.value) for a in span.attributes},
                                    span.status.code,
                                    span.status.message,
                                    span.SerializeToString(deterministic=True),
                                )
                            )
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
