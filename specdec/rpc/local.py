"""In-process transport: a channel whose calls run a servicer's handlers directly.

Why: the statistical tests drive thousands of generations through the real coordinator,
servicers and runners, and over loopback gRPC most of their time is transport. A
`LocalChannel` keeps everything above the sockets: every message is serialised and parsed
both ways with the real codecs, handlers get a context whose `abort` ends the call with its
status code (so clients see the same `grpc.aio.AioRpcError` and translate it the same way),
deadlines and caller cancellation reach the handler as they would over the wire. What it
leaves out: HTTP/2, message size limits, and server interceptors (auth, tracing). Generated
stubs take it in place of a `grpc.aio.Channel`, and the generated `add_*_to_server` functions
take it in place of a server.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LocalContext:
    """The part of `grpc.aio.ServicerContext` the servicers use."""

    def __init__(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout_s is None else loop.time() + timeout_s
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.writes: asyncio.Queue | None = None  # where a streaming handler's `write`s go

    async def write(self, message) -> None:
        if self.writes is None:
            raise RuntimeError("write is for server-streaming handlers")
        await self.writes.put(message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise _Abort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "in-process"

    def error(self, exc: BaseException) -> grpc.aio.AioRpcError:
        """What a client sees when the handler ended with `exc`, as grpc.aio reports it."""
        if isinstance(exc, _Abort):
            return rpc_error(exc.code, exc.details)
        if isinstance(exc, TimeoutError):
            return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self._code is not None:  # the generated base class's "Method not implemented!"
            return rpc_error(self._code, self._details)
        return rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")


def _same(message):
    """grpc's meaning of a missing (de)serialiser: the message is already bytes."""
    return message


class _Method:
    """One method of a stub; its handler is looked up per call, so a stub may be made first."""

    def __init__(
        self, channel: LocalChannel, method: str, serialize: Callable | None, deserialize: Callable | None
    ) -> None:
        self._channel = channel
        self._method = method
        self._serialize = serialize or _same
        self._deserialize = deserialize or _same

    def _parsed(self, request) -> tuple[grpc.RpcMethodHandler, Any]:
        handler = self._channel.handler(self._method)
        return handler, (handler.request_deserializer or _same)(self._serialize(request))

    def _reply(self, handler: grpc.RpcMethodHandler, response):
        return self._deserialize((handler.response_serializer or _same)(response))


class _UnaryUnary(_Method):
    async def __call__(self, request, timeout: float | None = None, **_: Any):
        handler, server_request = self._parsed(request)
        context = LocalContext(timeout)
        try:
            async with asyncio.timeout(timeout):
                response = await handler.unary_unary(server_request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the call's status, as on the wire
            raise context.error(exc) from None
        return self._reply(handler, response)


class _UnaryStream(_Method):
    def __call__(self, request, timeout: float | None = None, **_: Any) -> AsyncIterator:
        return self._responses(request, timeout)

    async def _responses(self, request, timeout: float | None) -> AsyncIterator:
        handler, server_request = self._parsed(request)
        context = LocalContext(timeout)
        try:
            async with asyncio.timeout(timeout):
                async for response in _handler_messages(handler.unary_stream(server_request, context), context):
                    yield self._reply(handler, response)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the call's status, as on the wire
            raise context.error(exc) from None


class _StreamStream(_Method):
    def __call__(self, request_iterator=None, timeout: float | None = None, **_: Any) -> LocalStreamCall:
        return LocalStreamCall(self, timeout)


_DONE_WRITING = object()


class LocalStreamCall:
    """A bidirectional call, as much of grpc.aio's StreamStreamCall as the coordinator's call
    streams use: write, read (grpc.aio.EOF at the end), done_writing, cancel, done, code, details.
    The handler runs inside the reader's task, as a unary handler runs inside the caller's, so
    cancelling a read cancels the handler's work just as cancelling the call does on the wire."""

    def __init__(self, method: _StreamStream, timeout: float | None) -> None:
        self._method = method
        self._context = LocalContext(timeout)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._handler: grpc.RpcMethodHandler | None = None
        self._responses: AsyncIterator | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def _incoming(self) -> AsyncIterator:
        assert self._handler is not None
        parse = self._handler.request_deserializer or _same
        while (message := await self._requests.get()) is not _DONE_WRITING:
            yield parse(self._method._serialize(message))

    async def write(self, message) -> None:
        if self._code is not None:
            raise rpc_error(self._code, self._details or "the call has ended")
        self._requests.put_nowait(message)

    async def done_writing(self) -> None:
        self._requests.put_nowait(_DONE_WRITING)

    async def read(self):
        if self._code is not None:
            raise rpc_error(self._code, self._details)
        try:
            if self._responses is None:
                self._handler = self._method._channel.handler(self._method._method)
                self._responses = self._handler.stream_stream(self._incoming(), self._context)
            response = await self._responses.__anext__()
        except StopAsyncIteration:
            self._code = grpc.StatusCode.OK
            return grpc.aio.EOF
        except asyncio.CancelledError:
            self._end(grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the call's status, as on the wire
            error = exc if isinstance(exc, grpc.aio.AioRpcError) else self._context.error(exc)
            self._end(error.code(), error.details() or "")
            raise error from None
        return self._method._reply(self._handler, response)

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def cancel(self) -> bool:
        if self._code is not None:
            return False
        self._end(grpc.StatusCode.CANCELLED, "the call was cancelled")
        if self._responses is not None:
            asyncio.ensure_future(self._responses.aclose())  # type: ignore[attr-defined]
        return True

    def done(self) -> bool:
        return self._code is not None

    async def code(self) -> grpc.StatusCode | None:
        return self._code

    async def details(self) -> str:
        return self._details


async def _handler_messages(result, context: LocalContext) -> AsyncIterator:
    """A server-streaming handler's messages, whether it yields them (an async generator) or
    writes them with `context.write` (a coroutine), as grpc.aio allows both."""
    if inspect.isasyncgen(result):
        try:
            async for message in result:
                yield message
        finally:
            await result.aclose()
        return
    finished = object()
    queue: asyncio.Queue = asyncio.Queue()
    context.writes = queue

    async def run() -> None:
        try:
            await result
        finally:
            queue.put_nowait(finished)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not finished:
            yield message
        await task  # the handler's own error, if it ended with one
    finally:
        task.cancel()


class LocalChannel:
    """Register servicers on it as on a server, then hand it to stubs as a channel."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self.closed = False

    # Server side: what the generated add_*Servicer_to_server functions call.
    def add_generic_rpc_handlers(self, handlers) -> None:
        """Unused: the generated code registers every method by name as well."""

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._handlers[f"/{service_name}/{name}"] = handler

    # Client side: what the generated stubs call.
    def unary_unary(self, method: str, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _UnaryUnary(self, method, request_serializer, response_deserializer)

    def unary_stream(self, method: str, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _UnaryStream(self, method, request_serializer, response_deserializer)

    def stream_stream(self, method: str, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _StreamStream(self, method, request_serializer, response_deserializer)

    def handler(self, method: str) -> grpc.RpcMethodHandler:
        if self.closed:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the local channel is closed")
        try:
            return self._handlers[method]
        except KeyError:
            raise rpc_error(
                grpc.StatusCode.UNIMPLEMENTED, f"no servicer on this local channel serves {method}"
            ) from None

    async def close(self, grace: float | None = None) -> None:
        self.closed = True
