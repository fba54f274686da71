"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions and /v1/chat/completions.

Served by the coordinator process beside its gRPC API (`--http-port`), on aiohttp: an
asyncio server that runs in the coordinator's own event loop, so an HTTP request drives the
same `Engine.generate` as a gRPC one, with no thread hop or second loop. Requests and
responses follow OpenAI's shapes (what the official `openai` client sends and parses);
`stream: true` is served as server-sent events ending with `data: [DONE]`. The same bearer
tokens and TLS files as the gRPC API apply, a W3C `traceparent` header joins the caller's
trace, and finished requests feed the same metrics.

Extras beyond OpenAI's fields: a request may set `num_speculative_tokens`,
`draft_min_confidence`, `tree_widths`, `cache_salt`, `top_k` and the acceptance rule
(`acceptance_mode`, `relaxed_top_n`, `relaxed_delta`); every response carries `speculation`
(acceptance, tokens per round, rounds, draft tokens proposed and accepted, and the acceptance
mode that produced it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from opentelemetry import propagate, trace

from coordinator import openai_events
from coordinator.engine import Engine
from coordinator.metrics import CoordinatorMetrics, GenerationStats
from coordinator.openai_events import (
    end_stream,
    first_chunks,
    next_chunk,
    raise_if_failed,
    relay_chunks,
    send_event,
    stop_choices,
    stream_event,
)
from coordinator.openai_schema import (
    FINISH_REASONS,
    ApiError,
    Parsed,
    api_error,
    chat_logprobs,
    completion_logprobs,
    parse_request_body,
    speculation,
    usage,
)
from coordinator.requests import Chunk
from coordinator.servicer import metered
from specdec.config.services import ServerSecurity
from specdec.rpc.security import BearerTokenAuth, bearer_token, read_tokens
from specdec.rpc.serving import MAX_METADATA_BYTES

logger = logging.getLogger(__name__)
MAX_WARNED = 256  # distinct unknown field names logged, at most (a client may make up any)
tracer = trace.get_tracer("specdec.coordinator.http")

T = TypeVar("T")
PATHS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")


IGNORED_HEADER = "X-Specdec-Ignored-Fields"
HTTP_MAX_HEADERS = 64  # the official client sends about 20
MAX_TOKENS_PARAM = web.RequestKey("max_tokens_param", str)  # the body's name for it, which errors name


def ignored_header(parsed: Parsed) -> dict[str, str]:
    """The response header naming the request's fields this server left out (none: no header),
    so a client can see what it was not served without reading the server's log."""
    if not parsed.ignored:
        return {}
    return {IGNORED_HEADER: ", ".join(ascii(name)[1:-1] for name in parsed.ignored)[:1000]}


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


async def collect(chunks: AsyncGenerator[Chunk, None]) -> list[Chunk]:
    """Every chunk of one generation (closed at once if the caller goes away)."""
    async with contextlib.aclosing(chunks):
        return [chunk async for chunk in chunks]


async def all_of(awaitables: list[Awaitable[T]]) -> list[T]:
    """Each result, in order, run at once. When one fails, or the caller goes away, the others
    are cancelled (their generations end) before the error goes on."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class OpenAIApi:
    """The HTTP handlers, bound to one coordinator."""

    def __init__(
        self,
        coordinator: Engine,
        model_name: str,
        metrics: CoordinatorMetrics | None = None,
        tokens: list[str] | None = None,
        body_limit: int = 1 << 20,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self.coordinator = coordinator
        self.serving = serving  # what the gRPC health service says: a target to serve with, not shutting down
        self._warned: set[str] = set()  # unknown request fields already logged
        self.model_name = model_name
        self.metrics = metrics
        self.auth = BearerTokenAuth(tokens) if tokens else None
        self.body_limit = body_limit

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.body_limit)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", lambda request: self.generate(request, chat=False))
        app.router.add_post("/v1/chat/completions", lambda request: self.generate(request, chat=True))
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Trace context, the token check and OpenAI error bodies around every handler."""
        context = propagate.extract(dict(request.headers))
        with tracer.start_as_current_span(
            f"{request.method} {request.path}", context=context, kind=trace.SpanKind.SERVER
        ) as span:
            try:
                if self.auth is not None and request.path != "/health":
                    problem = self.auth.problem(request.headers.get("Authorization"))
                    if problem is not None:
                        self.auth.log.refused(f"HTTP {request.method} {request.path}", problem)
                        raise ApiError(401, problem, "authentication_error", code="invalid_api_key")
                response = await handler(request)
            except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method
                response = error_response(ApiError(exc.status, exc.reason, "invalid_request_error"))
            except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's error shape
                error = api_error(exc, request.get(MAX_TOKENS_PARAM, "max_tokens"))
                if error.status == 500:
                    logger.exception("HTTP %s %s failed", request.method, request.path)
                response = error_response(error)
            span.set_attribute("http.status_code", response.status)
            if self.metrics is not None:
                path = request.path if request.path in PATHS else "other"  # bounded label values
                self.metrics.http_requests.labels(path, str(response.status)).inc()
            return response

    async def health(self, request: web.Request) -> web.Response:
        """200 while the coordinator serves, 503 while its gRPC health says NOT_SERVING (no
        target replica serving, or shutting down): an HTTP probe or load balancer sees what a
        gRPC one does."""
        if self.serving():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    def _warn_ignored(self, names: tuple[str, ...]) -> None:
        """Logs each field left out of a request once (a client sends the same ones every time),
        remembering at most MAX_WARNED names."""
        new = [name for name in names if name not in self._warned]
        if new and len(self._warned) < MAX_WARNED:
            self._warned.update(new)
            logger.warning("ignoring request fields this server does not know: %s", ", ".join(map(repr, new))[:1000])

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec"}
        return web.json_response({"object": "list", "data": [model]})

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()  # at most client_max_size, or HTTPRequestEntityTooLarge
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413,
                f"the request body is larger than {request.client_max_size} bytes, the most a valid request to "
                "this model can be (its context in tokens, stop strings and messages)",
                "invalid_request_error",
            ) from None
        parsed = await self.coordinator.off_loop(parse_request_body, raw, chat, self.model_name)
        self._warn_ignored(parsed.ignored)
        request[MAX_TOKENS_PARAM] = parsed.max_tokens_param
        if self.auth is not None:  # each checked token is its own cache namespace
            parsed = dataclasses.replace(
                parsed,
                request=dataclasses.replace(parsed.request, tenant=bearer_token(request.headers.get("Authorization"))),
            )
        # Each choice is a generation of its own, counted and logged as a gRPC request's is.
        generations = [metered(self.coordinator.generate(choice), self.metrics) for choice in parsed.choices()]
        if parsed.stream:
            return await self._stream(request, parsed, generations)
        everything = await all_of([collect(chunks) for chunks in generations])
        choices, finals = [], []
        for index, pieces in enumerate(everything):
            final = pieces[-1]
            assert final.stats is not None and final.finish_reason is not None
            finals.append(final.stats)
            text = "".join(piece.text for piece in pieces)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": FINISH_REASONS[final.finish_reason],
                "logprobs": self._logprobs(
                    parsed,
                    [t for piece in pieces for t in piece.token_ids],
                    [e for piece in pieces for e in piece.logprobs],
                ),
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return web.json_response(
            {
                **self._envelope(chat, streamed=False),
                "choices": choices,
                "usage": usage(*finals),
                "speculation": speculation(*finals),
            },
            headers=ignored_header(parsed),
        )

    def _logprobs(self, parsed: Parsed, token_ids: list[int], entries: list, offset: int = 0) -> dict | None:
        """A choice's `logprobs` in the endpoint's shape; None where the request asked for none."""
        if not parsed.request.logprobs:
            return None
        if parsed.chat:
            return chat_logprobs(self.coordinator.tokenizer, token_ids, entries)
        return completion_logprobs(self.coordinator.tokenizer, token_ids, entries, offset)

    def _envelope(self, chat: bool, streamed: bool) -> dict:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
        }

    async def _stream(
        self, request: web.Request, parsed: Parsed, generations: list[AsyncGenerator[Chunk, None]]
    ) -> web.StreamResponse:
        """Server-sent events in OpenAI's chunk format, each choice's as they come (`index` says
        whose; n = 1: one). The headers wait for every choice's first chunk up to KEEPALIVE_S,
        so a request refused up front (in milliseconds) still gets its HTTP error status; a
        longer wait (a long prompt's prefill) sends them, then keep-alives, so a proxy does
        not cut the stream as idle, and a refusal after that travels as an error event."""
        envelope = self._envelope(parsed.chat, streamed=True)
        queue: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()
        started = [asyncio.get_running_loop().create_future() for _ in generations]
        relays = [
            asyncio.ensure_future(relay_chunks(i, chunks, queue, started[i])) for i, chunks in enumerate(generations)
        ]
        try:
            await first_chunks(relays, started, openai_events.KEEPALIVE_S)  # a refusal raises here
        except BaseException:
            await stop_choices(relays, generations)
            raise
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **ignored_header(parsed)}
        )
        error: dict | None = None
        try:
            await response.prepare(request)
            if parsed.chat:
                for index in range(len(generations)):
                    await send_event(response, stream_event(envelope, parsed.chat, index, None, None, role=True))
            finals = await self._send_chunks(response, parsed, envelope, queue, relays)
            if parsed.include_usage:
                await send_event(response, {**envelope, "choices": [], "usage": usage(*finals)})
        except ConnectionError:
            logger.info("HTTP client went away mid-stream; the generation is cancelled")
            return response
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error travels as an event
            failure = api_error(exc, parsed.max_tokens_param)
            if failure.status == 500:  # the server's own, logged as the middleware logs one
                logger.exception("HTTP %s %s failed mid-stream", request.method, request.path)
            error = failure.body()
        finally:
            await stop_choices(relays, generations)
        await end_stream(response, error)
        return response

    async def _send_chunks(
        self,
        response: web.StreamResponse,
        parsed: Parsed,
        envelope: dict,
        queue: asyncio.Queue[tuple[int, Chunk | None]],
        relays: list[asyncio.Task],
    ) -> list[GenerationStats]:
        """Sends every choice's chunks from `queue` as events until each choice has ended;
        returns their final stats. A choice that failed raises its error here."""
        # Tokens whose text is held back (a partial character, a possible stop string) send
        # their logprobs with the choice's next event that carries text.
        pending_ids: list[list[int]] = [[] for _ in relays]
        pending: list[list] = [[] for _ in relays]
        # Where each choice's next token starts among its tokens' texts (completions' text_offset,
        # as the whole response counts them: text held back for a stop string included).
        offsets = [0] * len(relays)
        finals: list[GenerationStats] = []
        running = len(relays)
        while running:
            index, chunk = await next_chunk(response, queue)
            if chunk is None:
                running -= 1
                await raise_if_failed(relays[index], index)
                continue
            finish = FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason else None
            pending_ids[index] += chunk.token_ids
            pending[index] += chunk.logprobs
            if chunk.text or finish:
                logprobs = self._logprobs(parsed, pending_ids[index], pending[index], offsets[index])
                payload = stream_event(envelope, parsed.chat, index, chunk.text, finish, logprobs=logprobs)
                if logprobs is not None and logprobs.get("tokens"):  # completions' shape
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                pending_ids[index], pending[index] = [], []
                if chunk.stats is not None:
                    payload["speculation"] = speculation(chunk.stats)
                await send_event(response, payload)
            if chunk.stats is not None:
                finals.append(chunk.stats)
        return finals


def server_ssl_context(security: ServerSecurity) -> ssl.SSLContext | None:
    """The gRPC API's TLS files, for HTTPS: the same certificate and, with --tls-client-ca,
    the same client-certificate requirement."""
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_ca:
        context.load_verify_locations(security.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _MalformedUnlogged(logging.Filter):
    """A request aiohttp refuses before any handler runs (a header past the limits below, a
    malformed request line) gets its 400 and no ERROR traceback in the log: the caller's fault,
    and without a token one line each would let anyone fill the log (aiohttp itself logs non-HTTP
    traffic at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], BadHttpMessage))


MALFORMED_UNLOGGED = _MalformedUnlogged()


async def start_http(
    coordinator: Engine,
    model_name: str,
    host: str,
    port: int,
    security: ServerSecurity,
    metrics: CoordinatorMetrics | None = None,
    body_limit: int = 1 << 20,
    serving: Callable[[], bool] = lambda: True,
    grace_s: float = 25.0,
) -> tuple[web.AppRunner, int]:
    """Starts the API on `host:port` (0 picks a free port); returns the runner (cleanup()
    stops taking requests and lets those in flight finish for up to `grace_s`, as gRPC's
    --shutdown-grace) and the bound port. A body over `body_limit` bytes gets 413 unread past
    the limit; /health answers 503 while `serving()` is false."""
    tokens = read_tokens(security.auth_token_file, "--auth-token-file") if security.auth_token_file else None
    logging.getLogger("aiohttp.server").addFilter(MALFORMED_UNLOGGED)  # once: the same filter is added once
    # handler_cancellation: a client that goes away cancels its handler at once, so its
    # generation stops and both sessions are freed without waiting for the next write.
    # max_field_size, max_headers: the headers read before the token check are as much as gRPC's
    # metadata may be in all (aiohttp's own 128 headers of up to 1 MiB each let a caller without a
    # token pin 128 MiB a connection); a bearer token longer than a header may be (16 KiB, twice
    # the longest JWTs) gets aiohttp's 400, a shorter over-long one OpenAI's 401.
    runner = web.AppRunner(
        OpenAIApi(coordinator, model_name, metrics, tokens, body_limit, serving).app(),
        access_log=None,
        handler_cancellation=True,
        max_field_size=MAX_METADATA_BYTES // HTTP_MAX_HEADERS,
        max_headers=HTTP_MAX_HEADERS,
        shutdown_timeout=grace_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=server_ssl_context(security))
    try:
        await site.start()
    except OSError as exc:  # in one line, as a busy --port or --metrics-port is
        await runner.cleanup()
        raise SystemExit(f"cannot start: --http-port: could not listen on {host}:{port} ({exc.strerror})") from None
    bound = runner.addresses[0][1]
    scheme = "https" if security.tls_cert else "http"
    logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, host, bound)
    return runner, bound
