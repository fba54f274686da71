"""Coordinator gRPC servicer: GenerateRequest → GenerationRequest, chunks → GenerateResponse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import overload

import grpc
from google.protobuf.message import DecodeError

from coordinator.engine import Engine
from coordinator.metrics import CoordinatorMetrics, GenerationStats
from coordinator.requests import Chunk, GenerationRequest
from coordinator.state import MalformedReply
from specdec.errors import InvalidArgument, grpc_errors, status_of
from specdec.rpc.security import bearer_token
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class MalformedRequest:
    """A request body that does not parse as a GenerateRequest (corrupt wire format, a string
    that is not UTF-8). grpc.aio answers a deserializer that raises with UNKNOWN; handing the
    handler this instead lets it answer INVALID_ARGUMENT, as for any other bad request."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def parse_request(data: bytes) -> coordinator_pb2.GenerateRequest | MalformedRequest:
    try:
        return coordinator_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return MalformedRequest(str(exc))


def add_to_server(servicer: CoordinatorServicer, server: grpc.aio.Server) -> None:
    """`coordinator_pb2_grpc.add_CoordinatorServicer_to_server`, with requests parsed by `parse_request`."""
    respond = coordinator_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request, response_serializer=respond
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse_request, response_serializer=respond
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class ChatTurns(Sequence[tuple[str, str]]):
    """GenerateRequest.messages as (role, content) pairs, each read when it is used: the
    coordinator counts the turns before it reads one."""

    def __init__(self, messages) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, index: int) -> tuple[str, str]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, str]]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [(message.role, message.content) for message in self._messages[index]]
        message = self._messages[index]
        return message.role, message.content


def request_from_pb(request: coordinator_pb2.GenerateRequest, tenant: str = "") -> GenerationRequest:
    """The request as the domain sees it, copying nothing: its repeated fields are handed over
    as they arrived, so a request refused for its size costs no per-entry work."""

    def optional(name: str):
        return getattr(request, name) if request.HasField(name) else None

    return GenerationRequest(
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        max_new_tokens=optional("max_new_tokens"),
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=optional("top_p"),
        seed=optional("seed"),
        stop=request.stop,
        num_speculative_tokens=optional("num_speculative_tokens"),
        draft_min_confidence=optional("draft_min_confidence"),
        messages=ChatTurns(request.messages),
        tree_widths=request.tree_widths,
        cache_salt=request.cache_salt,
        acceptance_mode=request.acceptance_mode,
        relaxed_top_n=optional("relaxed_top_n"),
        relaxed_delta=optional("relaxed_delta"),
        tenant=tenant,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        logit_bias=request.logit_bias,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=optional("repetition_penalty"),
    )


# Every field of the message is read by name from GenerationStats (a field or a property); a
# unit test checks that the two list the same figures, so a new one cannot be left out.
STATS_FIELDS = tuple(field.name for field in coordinator_pb2.GenerationStats.DESCRIPTOR.fields)


def stats_to_pb(stats: GenerationStats) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(**{name: getattr(stats, name) for name in STATS_FIELDS})


def chunk_to_pb(chunk: Chunk) -> coordinator_pb2.GenerateResponse:
    response = coordinator_pb2.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs)
    if chunk.finish_reason is not None:
        response.finish_reason = chunk.finish_reason
    if chunk.stats is not None:
        response.stats.CopyFrom(stats_to_pb(chunk.stats))
    return response


async def metered(
    chunks: AsyncGenerator[Chunk, None], metrics: CoordinatorMetrics | None, expired: Callable[[], bool] = bool
) -> AsyncGenerator[Chunk, None]:
    """`chunks`, with the request counted in flight, then logged and counted by its outcome:
    what every request gets, from gRPC and from the HTTP API alike. The generation is closed
    as soon as this is (a client gone), so its sessions are freed at once. `expired()`: the
    client's deadline has passed, which cancels the handler as a client leaving does."""
    if metrics is not None:
        metrics.requests_in_flight.inc()
    finished = False  # counted as finished: a client leaving while its last chunk is sent is no second outcome
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.stats is not None:
                    log_finished(chunk.stats, chunk.finish_reason or "")
                    finished = True
                    if metrics is not None:
                        metrics.observe_finished(chunk.stats, chunk.finish_reason or "")
                yield chunk
    except BaseException as exc:
        if metrics is not None and not finished:
            cancelled = isinstance(exc, (asyncio.CancelledError, GeneratorExit))
            code = grpc.StatusCode.DEADLINE_EXCEEDED.name if cancelled and expired() else status_of(exc)
            metrics.observe_failed(code, isinstance(exc, MalformedReply))
        raise
    finally:
        if metrics is not None:
            metrics.requests_in_flight.dec()


def log_finished(s: GenerationStats, finish_reason: str) -> None:
    logger.info(
        "generated %d tokens (%s) in %.0f ms: %d rounds, %s acceptance %.2f, %.2f tokens/round",
        s.generated_tokens,
        finish_reason,
        s.total_ms,
        s.rounds,
        s.acceptance_mode,
        s.acceptance_rate,
        s.mean_accepted_length,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, engine: Engine, metrics: CoordinatorMetrics | None = None, tokens_checked: bool = False) -> None:
        self._engine = engine
        self._metrics = metrics
        # Bearer tokens are checked (--auth-token-file): each caller's token is its cache namespace.
        self._tokens_checked = tokens_checked

    async def _generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Chunk]:
        """The coordinator's chunks, with the request counted and logged (in its trace) once it ends."""

        async def chunks() -> AsyncGenerator[Chunk, None]:
            if isinstance(request, MalformedRequest):
                raise InvalidArgument(
                    f"the request is not a valid {coordinator_pb2.GenerateRequest.DESCRIPTOR.full_name} "
                    f"({request.reason}); "
                    "send a serialized GenerateRequest whose strings are UTF-8"
                )
            remaining = context.time_remaining()  # seconds, or None without a client deadline
            tenant = bearer_token(dict(context.invocation_metadata() or ()).get("authorization"))
            generation = request_from_pb(request, tenant if self._tokens_checked else "")
            async for chunk in self._engine.generate(generation, remaining):
                yield chunk

        def expired() -> bool:
            return (left := context.time_remaining()) is not None and left <= 0

        async for chunk in metered(chunks(), self._metrics, expired):
            yield chunk

    @grpc_errors
    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GenerateResponse:
        chunks = [chunk async for chunk in self._generate(request, context)]
        final = chunks[-1]
        return chunk_to_pb(
            Chunk(
                token_ids=[t for chunk in chunks for t in chunk.token_ids],
                text="".join(chunk.text for chunk in chunks),
                finish_reason=final.finish_reason,
                stats=final.stats,
                logprobs=[entry for chunk in chunks for entry in chunk.logprobs],
            )
        )

    @grpc_errors
    async def GenerateStream(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        async for chunk in self._generate(request, context):
            yield chunk_to_pb(chunk)
