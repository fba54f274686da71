"""An OTLP/gRPC trace receiver on loopback: the stand-in for Jaeger's OTLP ingest (port 4317)
in tests, built on opentelemetry-proto's own TraceService definition."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    start_ns: int = 0
    end_ns: int = 0


def _value(value: common_pb2.AnyValue):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class OtlpTraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; `start()` returns the endpoint to put in
    OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[event.name for event in span.events],
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(
        self, trace_id: str, complete: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """The trace's spans once `complete(spans)` holds (services export in batches, apart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if complete(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"trace {trace_id} incomplete after {timeout_s}s: {len(spans)} spans from services "
                    f"{sorted({s.service for s in spans})}, names {sorted({s.name for s in spans})}"
                )
            time.sleep(0.1)
