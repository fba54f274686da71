"""gRPC server plumbing shared by the three services: options, health, reflection, tracing,
metrics, shutdown, and the single model thread that every runner call goes through."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.rpc import keepalive, telemetry

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
    bound = (
        server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    )
    if bound == 0:
        raise SystemExit(f"could not listen on {address}")
    return bound


class ModelThread:
    """Runs runner calls one at a time on a dedicated thread, so the event loop keeps serving
    health checks and cancellations while a forward pass runs, and runner state is only ever
    touched from one thread."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Each counter has one writer (the event loop; the model thread; whoever cancels a job,
        # the event loop or shutdown), so reading them from any thread needs no lock.
        self._submitted = 0
        self._started = 0
        self._dropped = 0  # cancelled before they started: they never will
        self._brief: deque[tuple[Callable, tuple, asyncio.AbstractEventLoop, asyncio.Future]] = deque()  # run_brief

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self._submitted += 1
        job = self._executor.submit(self._start, fn, args)
        job.add_done_callback(self._count_dropped)
        return await asyncio.wrap_future(job)

    def _start(self, fn: Callable[..., T], args: tuple) -> T:
        self._started += 1
        return fn(*args)

    def _count_dropped(self, job: Future) -> None:
        if job.cancelled():
            self._dropped += 1

    def queued(self) -> bool:
        """Some call waits for the thread: a job that runs many steps yields to it."""
        return self._submitted > self._started + self._dropped or bool(self._brief)

    async def run_brief(self, fn: Callable[..., T], *args: Any) -> T:
        """`run` for a short job that runs no forward pass (EndSession, Info). A job that steps
        a batch on the thread runs it between two passes (`run_brief_jobs`), and its caller is
        answered then, rather than the batch ending first; with none running, it runs as `run`
        would, in its turn."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._brief.append((fn, args, loop, future))
        self._executor.submit(self.run_brief_jobs)
        return await future

    def run_brief_jobs(self) -> None:
        """On the model thread: runs every brief job waiting, in order, and answers each."""
        while True:
            try:
                fn, args, loop, future = self._brief.popleft()
            except IndexError:
                return
            try:
                outcome, failed = fn(*args), False
            except Exception as exc:  # noqa: BLE001 - raised in its caller
                outcome, failed = exc, True
            try:
                loop.call_soon_threadsafe(_resolve, future, outcome, failed)
            except RuntimeError:  # the loop has closed (shutdown): no caller is left to answer
                pass

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# A session used this recently is mid-generation (between its rounds) and likely to call again
# within a batch window; one idle longer (a client between requests, a session not yet ended)
# is not waited for: a lone active session's calls then run at once, whatever else is open.
ACTIVE_SESSION_S = 1.0


class CallBatcher(Generic[C, R]):
    """Gathers calls for one batched runner method and runs them on the model thread together.

    A batch starts `window_s` after the oldest waiting call arrived or the previous batch
    ended, whichever is later; earlier when `max_size` are waiting or when
    `more_expected(waiting)` says no other caller could join (e.g. every recently active
    session already has a call waiting, so a lone session never waits). Calls that queue while a batch runs
    go in the next one. Counting the window from the end of the previous batch lets the
    callers that batch just answered come back in time to join: without it, two sessions
    alternate forever, each one's call running alone while the other's is in flight.
    `run_batch(calls)` returns, per call, a result or the exception to raise in that caller
    alone. A caller cancelled before its batch starts is left out of it.

    With `answers_early`, `run_batch(calls, answer)` may also hand a call its result as soon
    as that call is done, `answer(index, result)` from the model thread, while the batch goes
    on with the others (a draft batch steps until its longest call is done): that caller goes
    on to its next call, and a batch's shortest calls no longer wait for its longest.

    With `joins` (and early answers), `run_batch(calls, answer, join)` may also take the calls
    that arrive while it runs: `join(held)`, from the model thread between its passes, hands
    over those waiting, oldest first (those it had no room for at its start come before any
    that arrived since), at most `max_size - held`, and the j-th call taken is index
    len(calls) + j of `answer` and of the results. Calls no batch took run in the next one.
    It takes none while another job waits for the model thread (`ModelThread.queued`), so a
    batch that others keep joining still ends and lets it run.
    """

    def __init__(
        self,
        model_thread: ModelThread,
        run_batch: Callable[..., list[R | Exception]],
        window_s: float,
        max_size: int,
        more_expected: Callable[[int], bool] = lambda waiting: True,
        answers_early: bool = False,
        joins: bool = False,
    ) -> None:
        if window_s < 0 or max_size < 1:
            raise ValueError(f"a batch window must be >= 0 s and a batch size >= 1; got {window_s} s and {max_size}")
        if joins and not answers_early:
            raise ValueError("a batch that calls join must answer them early: it may not end for a while")
        self._model_thread = model_thread
        self._run_batch = run_batch
        self._window_s = window_s
        self._max_size = max_size
        self._more_expected = more_expected
        self._answers_early = answers_early
        self._joins = joins
        self._waiting: list[tuple[C, asyncio.Future, float]] = []  # (call, its future, when it arrived)
        # Calls the running batch may take (joins): guarded by the lock, as the model thread takes them.
        self._lock = threading.Lock()
        self._joinable: list[tuple[C, asyncio.Future, float]] | None = None  # None: no batch takes calls now
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Task | None = None
        self._idle_since = float("-inf")  # loop time the previous batch ended

    async def submit(self, call: C) -> R:
        (result,) = await self.submit_all([call])
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_all(self, calls: list[C]) -> list[R | Exception]:
        """Several calls at once, in order: the next batch takes them together, or the running
        one as it has room (oldest first). → per call, its result or the exception it failed with."""
        loop = asyncio.get_running_loop()
        entries = [(call, loop.create_future(), loop.time()) for call in calls]
        with self._lock:
            joinable = self._joinable is not None
            if joinable:
                self._joinable.extend(entries)  # type: ignore[union-attr]
        if not joinable:
            self._waiting.extend(entries)
            self._schedule()
        return list(await asyncio.gather(*(future for _, future, _ in entries)))

    def _schedule(self) -> None:
        if self._running is not None:
            return  # the batch that is running starts the next one when it ends
        self._waiting = [entry for entry in self._waiting if not entry[1].done()]
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        wait_s = max(self._waiting[0][2], self._idle_since) + self._window_s - loop.time()
        if len(self._waiting) >= self._max_size or wait_s <= 0 or not self._more_expected(len(self._waiting)):
            self._start()
        elif self._timer is None:
            self._timer = loop.call_later(wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting[: self._max_size], self._waiting[self._max_size :]
        if self._joins:
            # From now on calls go to the batch that starts here, behind those it had no room
            # for: it takes them oldest first, and any it leaves run next, in the same order.
            with self._lock:
                self._joinable, self._waiting = self._waiting, []
        self._running = asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[C, asyncio.Future, float]]) -> None:
        loop = asyncio.get_running_loop()
        calls, futures = [call for call, _, _ in batch], [future for _, future, _ in batch]

        def answer(index: int, result: R | Exception) -> None:  # on the model thread
            try:
                loop.call_soon_threadsafe(_settle, futures[index], result)
            except RuntimeError:  # the loop has closed (shutdown): no caller is left to answer
                pass

        def join(held: int) -> list[C]:  # on the model thread, between passes
            self._model_thread.run_brief_jobs()
            if self._model_thread.queued():
                return []
            room = max(0, self._max_size - held)
            with self._lock:
                waiting = [entry for entry in self._joinable or () if not entry[1].done()]
                taken, self._joinable = waiting[:room], waiting[room:]
            futures.extend(future for _, future, _ in taken)
            return [call for call, _, _ in taken]

        try:
            extra = (answer, join) if self._joins else (answer,) if self._answers_early else ()
            results: list = await self._model_thread.run(self._run_batch, calls, *extra)
        except BaseException as exc:  # noqa: BLE001 - the callers get it; this task only relays
            results = [exc] * len(futures)
        finally:
            with self._lock:
                left, self._joinable = self._joinable or [], None
            # In the order they arrived: with joins, every call waits in `_joinable` while one runs.
            self._waiting = left + self._waiting
            self._running = None
            self._idle_since = loop.time()
        for future, result in zip(futures, results):
            _settle(future, result)  # a call answered early keeps that answer
        self._schedule()


def _resolve(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    """A brief job's outcome to its caller: the value, or the exception it raises there."""
    if future.done():
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _settle(future: asyncio.Future, result: Any) -> None:
    """A batched call's result to its caller: the value, or the exception it raises there."""
    if future.done():
        return
    if isinstance(result, asyncio.CancelledError):
        future.cancel()
    elif isinstance(result, BaseException) and not isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


async def expire_sessions_periodically(model_thread: ModelThread, expire: Callable[[], int], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        expired = await model_thread.run(expire)
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
        self.stopping = False  # health stays NOT_SERVING from the first signal on

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_http is None else self.metrics_http.server_port

    async def stop(self, grace_s: float | None = None) -> None:
        self.stopping = True
        await set_serving(self.health, self.service_names, False)
        for task in self._background:
            task.cancel()
        await self.server.stop(grace_s)
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
) -> RunningServer:
    """What the draft and target servers share: one model thread, the servicer, health and
    reflection, and periodic expiry of idle sessions.

    The model loads (weights, quantisation, cost calibration) on the model thread that then
    serves it, so all of a process's forward passes run on one thread. Why: torch's CPU
    kernels use OpenMP, which gives every thread that starts parallel work a thread team of
    its own; with a second team (the event loop's, from loading there) the process runs more
    OpenMP threads than it has cores, libgomp then stops spinning between parallel regions,
    and every forward pass of a small model, made of many short parallel regions, pays for
    it (measured: docs/design.md, "Services sharing cores")."""
    model_thread = model_thread_for(service_name)
    if runner is None:
        runner = await model_thread.run(load)
    servicer, model_thread, registry = build_model_servicer(config, runner, make_servicer, service_name, model_thread)
    return await start_server(
        lambda server: add_servicer(servicer, server),
        [service_name],
        config.host,
        config.port,
        config.max_message_bytes,
        background=[
            lambda: expire_sessions_periodically(model_thread, runner.expire_sessions, min(config.session_ttl_s, 30.0))
        ],
        on_stop=model_thread.shutdown,
        credentials=credentials,
        interceptors=interceptors,
        metrics=(registry, config.metrics_port),
    )


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
    await running.serve_until_signal(shutdown_grace_s)


ServiceConfig = TypeVar("ServiceConfig", bound="ModelServiceConfig")


def leave_torch_to_the_model_thread(config: ServiceConfig) -> ServiceConfig:
    """Called first thing in a model service's process: the calling (event loop) thread keeps
    one torch thread for its own small tensor work, so only the model thread, which loads
    and serves the model with `config.threads` threads (torch's default when unset), ever starts an
    OpenMP team (see start_model_server)."""
    threads = config.torch_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return dataclasses.replace(config, threads=threads)
