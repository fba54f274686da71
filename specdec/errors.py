"""Domain errors and the one place that maps them to gRPC status codes.

Runners raise these (they know nothing of gRPC); servicers let `grpc_errors` translate them,
so a client always gets a specific code and a message saying what was wrong.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

logger = logging.getLogger(__name__)


class SpecDecError(Exception):
    """Base class; `code` is the gRPC status the error maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecDecError):
    """`field`: the GenerateRequest field at fault, where one is (the HTTP API names its own
    parameter for it)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# The most characters an error message quotes of a client's value: a refusal never echoes a
# megabyte back (nor spends the time to format one).
SHOWN_CHARS = 80


def shown(value: object, quote: bool = True, limit: int = SHOWN_CHARS) -> str:
    """A client's value as an error message quotes it: its repr (its str, unquoted), cut to
    `limit` characters and saying how long it was. A long list or string is cut before it is
    formatted."""
    size = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else None
    if isinstance(value, (list, tuple)) and len(value) > limit:
        value = value[:limit]
    elif isinstance(value, (str, bytes)) and len(value) > 4 * limit:
        value = value[: 4 * limit]
    text = repr(value) if quote else str(value)
    if len(text) <= limit:
        return text
    unit = "items" if isinstance(value, (list, tuple, dict)) else "characters"
    return f"{text[:limit]}… ({size if size is not None else len(text)} {unit})"


class SessionNotFound(SpecDecError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(SpecDecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StaleRequest(SpecDecError):
    """A call superseded by a newer one for the same session (a cancelled pre-draft)."""

    code = grpc.StatusCode.ABORTED


class Unavailable(SpecDecError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(Unavailable):
    """A service answered too slowly: for the client still UNAVAILABLE, but for the draft it
    means "skip it this round", never "retry and wait again"."""


class ModelOutputError(SpecDecError):
    """A model produced NaN or infinite logits (a broken checkpoint, an overflow in low
    precision). INTERNAL, saying which model and where: argmax and sampling would otherwise pick
    an arbitrary token and the output would silently stop being the target's."""


class JobGivenUp(SpecDecError):
    """A job stopped before or between its passes: its caller no longer waits for it
    (specdec.rpc.model_thread.ModelThread.between_passes; specdec.engine.batching.stopping). A
    refusal, not a failure: kept without its traceback in a batch's results (whose frames would
    hold the ended session's pages) and never logged as an unexpected error."""

    code = grpc.StatusCode.CANCELLED


class ServiceRefused(SpecDecError):
    """A model service refused the coordinator's credentials: a deployment mistake, never the
    public caller's, so it stays INTERNAL rather than UNAUTHENTICATED."""


F = TypeVar("F", bound=Callable[..., Any])


def status_of(exc: BaseException) -> str:
    """The status code name a request that raised `exc` ends with (as `_abort` maps it)."""
    if isinstance(exc, SpecDecError):
        return exc.code.name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return grpc.StatusCode.RESOURCE_EXHAUSTED.name
    return grpc.StatusCode.INTERNAL.name


def error_fields(exc: Exception) -> dict[str, Any]:
    """error_code and error_message of a call answered inside a reply message (a branch of
    ProposeBranches, a message on a call stream), with the code `_abort` would end a unary
    call with."""
    code = grpc.StatusCode[status_of(exc)]
    if code == grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in a call", exc_info=exc)
    return {"error_code": code.value[0], "error_message": str(exc) or type(exc).__name__}


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """Ends the call with `exc`'s status code (context.abort raises)."""
    if isinstance(exc, SpecDecError):
        await context.abort(exc.code, str(exc))
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}")
    logger.exception("unexpected error in handler")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    raise AssertionError("context.abort returned")


def grpc_errors(handler: F) -> F:
    """Wraps a unary or server-streaming aio handler so domain errors become status codes."""
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self, request, context) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                await _abort(context, exc)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary_wrapper(self, request, context) -> Awaitable[Any]:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            await _abort(context, exc)

    return unary_wrapper  # type: ignore[return-value]
