"""gRPC server plumbing shared by the three services: options, health, reflection, tracing,
metrics and shutdown. The model thread every runner call goes through, and the batcher that
gathers calls for it, are in specdec.rpc.model_thread."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.engine.rows import MAX_ROWS
from specdec.rpc import keepalive, telemetry
from specdec.rpc.model_thread import ModelThread

if TYPE_CHECKING:
    from specdec.config.services import ModelServiceConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")  # a call a batcher gathers
R = TypeVar("R")  # what one call returns


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s trace_id=%(trace_id)s span_id=%(span_id)s: %(message)s"


def configure_logging(level: str) -> None:
    """Every line carries the trace and span it was logged in ("-" outside a request)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(telemetry.TraceContextFilter())


# A call's metadata may be this large (gRPC's default is 8 KiB): a bearer token longer than any
# accepted one is read and refused as UNAUTHENTICATED, not cut off as RESOURCE_EXHAUSTED.
MAX_METADATA_BYTES = 1 << 20


# What every message limit starts from: a round of K dense draft distributions over a 152k
# vocabulary is 0.6 MB per token.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# gRPC's own ceiling for one message: its length is a signed 32-bit integer.
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


def model_message_bytes(vocab_size: int, max_context: int, feature_bytes: int = 0) -> int:
    """A model service's message limit, from its model's shape: a call's rows (MAX_ROWS) each
    carrying a distribution over the vocabulary (wire.encode_distributions sends a row sparse
    only while it has at most half the vocabulary's entries, so at most 4.5 bytes an entry,
    dense 4), ids for a sequence as long as the context (a re-sent session; at most 5 bytes each,
    counted twice), hidden features for as many positions (`feature_bytes` a position:
    `feature_bytes_per_position`), and a MiB for the rest. Never under
    DEFAULT_MAX_MESSAGE_BYTES, nor over gRPC's ceiling. The coordinator's channels to the
    services set no limit of their own."""
    bound = MAX_ROWS * (9 * vocab_size // 2 + 32) + (10 + feature_bytes) * max_context + (1 << 20)
    return min(max(bound, DEFAULT_MAX_MESSAGE_BYTES), GRPC_MAX_MESSAGE_BYTES)


def feature_bytes_per_position(runner, service_name: str) -> int:
    """The hidden features (EAGLE heads) a service's message may carry a position, at 4 bytes a
    value (feature_dtype float32): a target's reply with three layers (EAGLE-3's), an EAGLE
    draft's request as wide as its head reads; 0 for any other draft. A prompt's first verify
    carries the features of every position it ran."""
    if service_name.endswith(".Target"):
        return 3 * int(runner.model.config.get_text_config().hidden_size) * 4
    return int(getattr(runner, "feature_width", 0)) * 4


def message_size_options(max_message_bytes: int, max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
    ]


def create_server(
    max_message_bytes: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
    public: bool = False,
) -> grpc.aio.Server:
    """Tracing first (so the span covers a refused token too), then the security interceptors.
    `max_receive_bytes` (default `max_message_bytes`): gRPC refuses a larger request with
    RESOURCE_EXHAUSTED before anything decodes it. `public`: users' clients connect (the
    coordinator), so idle and old connections are closed (keepalive.public_server_options)."""
    chain = [*telemetry.server_interceptors(), *interceptors]
    options = [
        *message_size_options(max_message_bytes, max_receive_bytes),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        # gRPC's default lets a second server bind a port in use and share its connections
        # with the first (a stale service, an old model): refused instead (`bind`).
        ("grpc.so_reuseport", 0),
        *(keepalive.public_server_options() if public else keepalive.server_options()),
    ]
    return grpc.aio.server(interceptors=chain or None, options=options)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> health.aio.HealthServicer:
    """Standard health service (starts NOT_SERVING) and reflection, so grpcurl can list/describe."""
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


# A health service name that answers SERVING from start-up to exit: what a liveness probe asks
# (the process and its event loop answer), where "" and the API's own name say whether it can
# serve now (readiness: the coordinator with no target replica serving, or any server while it
# drains, says NOT_SERVING, which must not get it restarted).
LIVENESS = "liveness"


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listens on host:port, with TLS when `credentials` are given (health and reflection too)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpcio's "Failed to bind"
        bound = 0
    if bound == 0:
        raise SystemExit(f"cannot start: could not listen on {address} (another process holds the port, or the host "
                         "is not an address of this machine)")  # fmt: skip
    return bound


async def expire_sessions_periodically(model_thread: ModelThread, expire: Callable[[], int], every_s: float) -> None:
    """Ends idle sessions every `every_s` until cancelled. A round that fails (a prefix-cache
    block's copy out of device memory) is logged and the next one runs: the task ending would
    leave idle sessions held until a new session's opening expires them."""
    while True:
        await asyncio.sleep(every_s)
        try:
            expired = await model_thread.run(expire)
        except Exception:  # noqa: BLE001 - logged; the next round tries again
            logger.exception("expiring idle sessions failed; trying again in %.0f s", every_s)
            continue
        if expired:
            logger.info("expired %d idle sessions", expired)


def bound_address(host: str, port: int) -> str:
    """HOST:PORT as the start-up log names it, saying who can reach it: a loopback address
    only this machine (the default --host), 0.0.0.0 / :: every interface."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host.startswith("127.") or host in ("localhost", "::1"):
        return f"{shown} (this machine only; --host 0.0.0.0 to serve other machines)"
    if host in ("0.0.0.0", "::", "[::]"):
        return f"{shown} (every interface)"
    return shown


class RunningServer:
    """A started server with what must be stopped along with it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        health_servicer: health.aio.HealthServicer,
        service_names: list[str],
        background: list[asyncio.Task] | None = None,
        on_stop: Callable[[], Any] | None = None,
        metrics_http=None,
        host: str = "",
    ) -> None:
        self.server = server
        self.host = host  # the address bound, as --host gave it
        self.port = port
        self.health = health_servicer
        self.service_names = service_names
        self._background = background or []
        self._on_stop = on_stop
        self.metrics_http = metrics_http  # None when metrics are off
        self.http_port: int | None = None  # the coordinator's HTTP API, when it serves one
        # Other servers' drains (the coordinator's HTTP API), run beside gRPC's at `stop`.
        self.drains: list[Callable[[], Awaitable[Any]]] = []
        self.stopping = False  # health stays NOT_SERVING from the first signal on

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_http is None else self.metrics_http.server_port

    async def stop(self, grace_s: float | None = None) -> None:
        self.stopping = True
        await set_serving(self.health, self.service_names, False)
        for task in self._background:
            task.cancel()
        await asyncio.gather(self.server.stop(grace_s), *(drain() for drain in self.drains))
        if self._on_stop:
            result = self._on_stop()
            if inspect.isawaitable(result):
                await result
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
        telemetry.shutdown_tracing()

    async def serve_until_signal(self, grace_s: float = 25.0, notice_s: float = 1.0) -> None:
        """On SIGTERM/SIGINT: health turns NOT_SERVING first and stays answerable for
        `notice_s`, so probes and load balancers stop sending new work; then the server
        stops accepting and in-flight requests get up to `grace_s` to finish."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        logger.info("serving %s on %s", ", ".join(self.service_names), bound_address(self.host, self.port))
        await stop.wait()
        logger.info("shutting down: NOT_SERVING now, then draining in-flight requests for up to %.1fs", grace_s)
        self.stopping = True
        await set_serving(self.health, self.service_names, False)
        await asyncio.sleep(min(notice_s, grace_s))
        await self.stop(grace_s)
        logger.info("stopped")


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    host: str,
    port: int,
    max_message_bytes: int,
    background: Sequence[Callable[[], Any]] = (),
    on_stop: Callable[[], Any] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: tuple[CollectorRegistry, int] | None = None,
    max_receive_bytes: int | None = None,
    public: bool = False,
) -> RunningServer:
    """Creates, binds and starts a server with health (SERVING once started), reflection,
    and `metrics` = (registry, port) served over HTTP on the same host; `credentials` and
    `interceptors` come from `specdec.rpc.security.load_server_security`."""
    server = create_server(max_message_bytes, interceptors, max_receive_bytes, public)
    register(server)
    health_servicer = add_health_and_reflection(server, service_names)
    bound = bind(server, host, port, credentials)
    metrics_http = telemetry.start_metrics_server(metrics[0], host, metrics[1]) if metrics else None
    await server.start()
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await set_serving(health_servicer, service_names, True)
    tasks = [asyncio.create_task(make()) for make in background]
    return RunningServer(server, bound, health_servicer, service_names, tasks, on_stop, metrics_http, host)


def model_thread_for(service_name: str) -> ModelThread:
    return ModelThread(f"{service_name.rsplit('.', 1)[-1].lower()}-model")  # "draft-model" / "target-model"


def build_model_servicer(
    config, runner, make_servicer: Callable[..., Any], service_name: str, model_thread: ModelThread | None = None
) -> tuple[Any, ModelThread, CollectorRegistry]:
    """A model service's servicer with its own model thread (a new one unless given) and
    metrics registry."""
    role = service_name.rsplit(".", 1)[-1].lower()  # "draft" or "target"
    model_thread = model_thread or model_thread_for(service_name)
    # A prefill cut in passes answers Info and stops when given up. A tensor-parallel runner's
    # ranks must all run the same passes: its wrapper keeps the attribute, its ranks never see it.
    runner.between_passes = model_thread.between_passes
    registry = CollectorRegistry()
    servicer = make_servicer(
        runner,
        model_thread,
        telemetry.ModelServiceMetrics(registry, role, runner),
        config.batch_window_ms / 1e3,
        config.max_batch_size,
    )
    return servicer, model_thread, registry


async def start_model_server(
    config,  # a specdec.config.services.ModelServiceConfig
    runner,  # a specdec.engine.runner.ModelRunner, or None to load one with `load`
    load: Callable[[], Any],
    make_servicer: Callable[..., Any],  # (runner, model thread, metrics, batch window s, max batch size)
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    model_thread: ModelThread | None = None,
) -> RunningServer:
    """What the draft and target servers share: one model thread, the servicer, health and
    reflection, and periodic expiry of idle sessions. A `model_thread` given is its caller's
    (services sharing one process, as tests' in-process stacks do), who shuts it down; else the
    server makes its own and shuts it down when it stops.

    The model loads (weights, quantisation, cost calibration) on the model thread that then
    serves it, so all of a process's forward passes run on one thread. Why: torch's CPU
    kernels use OpenMP, which gives every thread that starts parallel work a thread team of
    its own; with a second team (the event loop's, from loading there) the process runs more
    OpenMP threads than it has cores, libgomp then stops spinning between parallel regions,
    and every forward pass of a small model, made of many short parallel regions, pays for
    it (measured: docs/design.md, "Services sharing cores")."""
    owned = model_thread is None
    model_thread = model_thread or model_thread_for(service_name)
    if runner is None:
        runner = await model_thread.run(load)
    servicer, model_thread, registry = build_model_servicer(config, runner, make_servicer, service_name, model_thread)
    description = runner.describe()
    message_bytes = model_message_bytes(
        description.vocab_size, description.max_context, feature_bytes_per_position(runner, service_name)
    )
    logger.info("messages larger than %d bytes are refused", message_bytes)
    running = await start_server(
        lambda server: add_servicer(servicer, server),
        [service_name],
        config.host,
        config.port,
        message_bytes,
        background=[
            lambda: expire_sessions_periodically(model_thread, runner.expire_sessions, min(config.session_ttl_s, 30.0))
        ],
        on_stop=model_thread.shutdown if owned else None,
        credentials=credentials,
        interceptors=interceptors,
        metrics=(registry, config.metrics_port),
    )
    running.drains.append(servicer.end_idle_streams)
    return running


async def serve_forever(
    build: Callable[[], Any], log_level: str, service_name: str, shutdown_grace_s: float = 25.0
) -> None:
    """Configures logging and tracing, builds the server and serves until SIGTERM/SIGINT. A
    start-up failure (model not found, services unreachable, mismatched pair) exits with
    status 2 and a one-line reason instead of a traceback."""
    from specdec.errors import SpecDecError

    configure_logging(log_level)
    telemetry.setup_tracing(service_name)
    try:
        running = await build()
    except (SpecDecError, OSError, ValueError) as exc:
        logger.error("cannot start: %s", exc)
        raise SystemExit(2) from None
    freeze_start_up_objects()
    await running.serve_until_signal(shutdown_grace_s)


def freeze_start_up_objects() -> None:
    """Moves every object start-up made (torch, transformers, the tokenizer, the model's
    modules: about 245,000 in the coordinator) out of the collector's sight, for good: they
    live as long as the process. Each full collection scanned them all, 150 ms in the
    coordinator's process on a 2-core EPYC, with the event loop stopped and the GIL held, so
    every request in flight stalled. What serving allocates is collected as before."""
    gc.collect()
    gc.freeze()


ServiceConfig = TypeVar("ServiceConfig", bound="ModelServiceConfig")


def leave_torch_to_the_model_thread(config: ServiceConfig) -> ServiceConfig:
    """Called first thing in a model service's process: the calling (event loop) thread keeps
    one torch thread for its own small tensor work, so only the model thread, which loads
    and serves the model with `config.threads` threads (torch's default when unset), ever starts an
    OpenMP team (see start_model_server)."""
    threads = config.torch_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return dataclasses.replace(config, threads=threads)
