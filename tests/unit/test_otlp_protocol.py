"""OTEL_EXPORTER_OTLP_PROTOCOL picks the span exporter: gRPC by default, OTLP over HTTP
(protobuf) where a collector takes that; one the SDK cannot speak is a start-up error."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from specdec.rpc import telemetry
from specdec.rpc.telemetry import span_exporter, trace_protocol


@pytest.mark.parametrize(
    "env, protocol",
    [
        ({}, "grpc"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "grpc"),
    ],
)
def test_the_protocol_is_the_environments(env, protocol):
    assert trace_protocol(env) == protocol


def test_a_protocol_the_sdk_cannot_speak_is_refused_with_the_choices():
    with pytest.raises(SystemExit, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json': choose one of grpc, http/protobuf"):
        trace_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_http_protobuf_spans_reach_an_http_collector(monkeypatch):
    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        exporter = span_exporter()
        assert isinstance(exporter, HttpExporter)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("test").start_as_current_span("round"):
            pass
        provider.shutdown()
    finally:
        server.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    spans = ExportTraceServiceRequest.FromString(received[0][1]).resource_spans[0].scope_spans[0].spans
    assert [span.name for span in spans] == ["round"]
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    assert isinstance(span_exporter(), GrpcExporter)


def test_a_hung_collector_holds_shutdown_for_at_most_the_flush_bound(monkeypatch):
    """The SDK's force_flush ignores its timeout while an export waits on a collector that
    accepted and never answers (about 10 s an attempt): shutdown waits only the bound."""
    import time

    released = threading.Event()

    class Hung:
        def force_flush(self, timeout_ms):
            released.wait(10)

    monkeypatch.setattr(telemetry, "_provider", Hung())
    started = time.monotonic()
    telemetry.shutdown_tracing(200)
    waited = time.monotonic() - started
    released.set()
    assert waited < 2.0, waited
