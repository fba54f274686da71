"""Tracing, metrics and log correlation shared by the three services.

Tracing follows OpenTelemetry's own configuration: it is on when `OTEL_EXPORTER_OTLP_ENDPOINT`
(or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set and `OTEL_SDK_DISABLED` is not true, and the
SDK reads the rest (`OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, `OTEL_EXPORTER_OTLP_INSECURE`,
...). `OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`) picks the exporter: `grpc`, the
default (a collector's port 4317), or `http/protobuf` (port 4318, which many collectors and
hosted backends take). Spans leave through a batch processor on a background thread, so a slow or absent
collector costs requests nothing (the exporter drops what it cannot send). Without an
endpoint nothing is installed: the API's no-op tracer answers, and no gRPC interceptor runs.

Metrics are Prometheus (prometheus-client), one registry per server so servers in one process
(tests) never share counters, served over HTTP on the service's metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping

import grpc
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("specdec")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")  # the first set wins
PROTOCOLS = ("grpc", "http/protobuf")
_provider = None  # the SDK provider this process installed, if any


def tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name) for name in _ENDPOINT_VARIABLES)


def trace_protocol(env: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol the environment asks for (`grpc` unless it says otherwise); one this
    SDK cannot speak (`http/json`) stops the process at start-up with the choices named."""
    env = os.environ if env is None else env
    for name in _PROTOCOL_VARIABLES:
        if value := env.get(name, "").strip():
            if value not in PROTOCOLS:
                raise SystemExit(f"{name}={value!r}: choose one of {', '.join(PROTOCOLS)}")
            return value
    return "grpc"


def span_exporter(env: Mapping[str, str] | None = None):
    """The OTLP span exporter for `trace_protocol`; it reads its endpoint, headers and TLS
    settings from the environment itself."""
    if trace_protocol(env) == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter()


def setup_tracing(default_service_name: str) -> bool:
    """Installs the SDK with an OTLP exporter (`span_exporter`) when the environment asks for
    it; once per process. Returns whether tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if not tracing_requested():
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override the default name.
    resource = (
        Resource.create({SERVICE_NAME: default_service_name})
        if not os.environ.get("OTEL_SERVICE_NAME")
        else Resource.create()
    )
    # The sampler comes from OTEL_TRACES_SAMPLER(_ARG). No flush at exit: `shutdown_tracing`'s
    # is bounded, the SDK's atexit one is not.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(span_exporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info(
        "tracing: exporting OTLP spans (%s) as %s", trace_protocol(), provider.resource.attributes.get(SERVICE_NAME)
    )
    return True


def shutdown_tracing(timeout_ms: int = 2000) -> None:
    """Flushes what is buffered for at most `timeout_ms`, so a dead or hung collector cannot
    hold up shutdown: the SDK's own flush ignores its timeout while an export waits (about
    10 s an attempt, opentelemetry-python #4568), so it runs on a daemon thread left behind."""
    if _provider is not None:
        flush = threading.Thread(target=_provider.force_flush, args=(timeout_ms,), name="otlp-flush", daemon=True)
        flush.start()
        flush.join(timeout_ms / 1e3)


def server_interceptors() -> list:
    """Continues the caller's trace in each RPC (a server span per call) when tracing is on."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list:
    """Sends the current trace context with each call when tracing is on."""
    return [] if _provider is None else [TracingClientInterceptor()]


def tracing_on() -> bool:
    return _provider is not None


# What `traced_span` and `client_span` give where tracing is off: the no-op span, the context untouched.
_NO_SPAN: contextlib.AbstractContextManager[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)


def traced_span(
    name: str, context=None, attributes: dict | None = None
) -> contextlib.AbstractContextManager[trace.Span]:
    """`tracer.start_as_current_span` where tracing is on. Where it is off, the no-op span
    without entering it into the context: the API's own no-op spans cost a context switch
    each, about a tenth of the coordinator's time per round with the table services."""
    if _provider is None:
        return _NO_SPAN
    return tracer.start_as_current_span(name, context=context, attributes=attributes)


def client_span(name: str, carrier) -> contextlib.AbstractContextManager[trace.Span]:
    """A client span for one call sent as a stream message, its context written into the
    message's `carrier` map: a message has no metadata of its own, and the service's span for
    the call continues this one (`context_of`), as it would a unary call's. None where tracing
    is off (`traced_span`)."""
    return _NO_SPAN if _provider is None else _client_span(name, carrier)


@contextlib.contextmanager
def _client_span(name: str, carrier) -> Iterator[trace.Span]:
    service, _, method = name.lstrip("/").rpartition("/")
    attributes: dict[str, str | bool] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": method,
        "specdec.on_stream": True,
    }
    with tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes) as span:
        propagate.inject(carrier)
        yield span


def record_status(span: trace.Span, code: int, details: str) -> None:
    """A call's status code on its client span (`rpc.grpc.status_code`), and ERROR where it failed."""
    span.set_attribute("rpc.grpc.status_code", code)
    if code:
        span.set_status(trace.Status(trace.StatusCode.ERROR, details))


def context_of(carrier: Mapping[str, str]):
    """The trace context a stream message carries (see client_span); None, the current
    context, when it carries none (a unary call: its metadata set the context already)."""
    return propagate.extract(carrier) if carrier else None


class TracingClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """A client span per unary call, its context sent in the metadata.

    Not opentelemetry-instrumentation-grpc's aio client interceptor: when its caller is
    cancelled it neither ends the span nor cancels the RPC, and the coordinator cancels stale
    pre-drafts and hedges by design. Their server spans would hang off a parent Jaeger never
    receives, and the draft would keep drafting tokens nobody reads.
    """

    async def intercept_unary_unary(self, continuation, details: grpc.aio.ClientCallDetails, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, _, name = method.lstrip("/").rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        with tracer.start_as_current_span(method, kind=trace.SpanKind.CLIENT, attributes=attributes) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
            call = await continuation(
                grpc.aio.ClientCallDetails(
                    details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
                ),
                request,
            )
            try:
                code = await call.code()  # the call's end
            except asyncio.CancelledError:
                call.cancel()  # the caller gave up (a stale pre-draft): cancel the RPC on the wire too
                raise  # ends the span with the error
            record_status(span, code.value[0], await call.details() if code != grpc.StatusCode.OK else "")
            return call


class TraceContextFilter(logging.Filter):
    """Adds the current trace and span ids to every record ("-" outside a span), so a log line
    can be found from its trace in Jaeger and the other way round."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        else:
            record.trace_id = record.span_id = "-"
        return True


def start_metrics_server(registry: CollectorRegistry, host: str, port: int):
    """Serves `registry` at http://host:port/metrics; port 0 picks a free one, -1 is off.
    Returns the HTTP server (`.server_port`, `.shutdown()`), or None when off."""
    if port < 0:
        return None
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SystemExit(f"cannot start: --metrics-port: could not listen on {host}:{port} ({exc.strerror})") from None
    logger.info("metrics on http://%s:%d/metrics", host, httpd.server_port)
    return httpd


# Model work per call: a draft step is tens of ms on CPU and ~1 ms on a GPU; a CPU verify ~0.2 s.
_FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class ModelServiceMetrics:
    """A draft or target service's metrics: model work per call, tokens run, sessions, KV bytes."""

    def __init__(self, registry: CollectorRegistry, role: str, runner) -> None:
        self.forward_seconds = Histogram(
            f"specdec_{role}_forward_seconds",
            f"Model work of one {role} call (all its forward passes)",
            ["rpc"],
            registry=registry,
            buckets=_FORWARD_BUCKETS,
        )
        self.processed_tokens = Counter(
            f"specdec_{role}_processed_tokens",
            "Tokens run through the model (prefix reuse keeps this low)",
            registry=registry,
        )
        self.batch_size = Histogram(
            f"specdec_{role}_batch_size",
            f"Sessions in the forward pass a {role} call ran in (1 = alone)",
            ["rpc"],
            registry=registry,
            buckets=_BATCH_SIZE_BUCKETS,
        )
        sessions = Gauge("specdec_sessions_open", "Sessions held (KV caches)", registry=registry)
        sessions.set_function(lambda: len(runner.sessions))
        kv_bytes = Gauge("specdec_kv_cache_bytes", "Bytes of KV cache held over all sessions", registry=registry)
        kv_bytes.set_function(runner.sessions.kv_bytes)
        budget = Gauge("specdec_kv_cache_budget_bytes", "KV cache budget (--max-kv-bytes); 0 = none", registry=registry)
        budget.set_function(lambda: runner.sessions.max_kv_bytes)
        overruns = Gauge(
            "specdec_emulation_overruns",
            "Passes whose real compute took longer than the emulated profile allows (0 without one: bench.emulated)",
            registry=registry,
        )
        overruns.set_function(lambda: getattr(getattr(runner, "pacer", None), "overruns", 0))
        registry.register(_EvictionCollector(runner.sessions))
        if runner.sessions.prefix is not None:
            registry.register(_PrefixCacheCollector(runner.sessions.prefix))

    def observe_call(self, rpc: str, compute_ms: float, processed_tokens: int, batch_size: int = 1) -> None:
        self.forward_seconds.labels(rpc).observe(compute_ms / 1e3)
        self.processed_tokens.inc(processed_tokens)
        self.batch_size.labels(rpc).observe(batch_size)


class _PrefixCacheCollector:
    """The prefix cache's figures (specdec.engine.prefix_cache), read from its own counters."""

    def __init__(self, prefix) -> None:
        self._prefix = prefix

    def collect(self):
        yield GaugeMetricFamily(
            "specdec_prefix_cache_bytes", "Bytes of KV held by the prefix cache", value=self._prefix.bytes
        )
        yield CounterMetricFamily(
            "specdec_prefix_cache_lookups", "New sessions that looked a cached prefix up", value=self._prefix.lookups
        )
        yield CounterMetricFamily(
            "specdec_prefix_cache_hits", "New sessions that started from a cached prefix", value=self._prefix.hits
        )
        yield CounterMetricFamily(
            "specdec_prefix_cache_saved_tokens",
            "Prefill tokens that cached prefixes spared",
            value=self._prefix.tokens_saved,
        )


class _EvictionCollector:
    """specdec_sessions_evicted_total, read from the session store's own count."""

    def __init__(self, sessions) -> None:
        self._sessions = sessions

    def collect(self):
        yield CounterMetricFamily(
            "specdec_sessions_evicted",
            "Sessions evicted (least recently used) to fit the KV budget",
            value=self._sessions.evicted,
        )
