"""The RPCs the draft and target services share: EndSession and Info, and answering a call
stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from specdec.engine.calls import ModelDescription
from specdec.engine.sessions import SessionStore
from specdec.errors import error_fields, grpc_errors
from specdec.rpc import wire
from specdec.rpc.model_thread import ModelThread
from specdec.v1 import common_pb2


class SessionRunner(Protocol):
    """What EndSession and Info need of a service's runner (a model runner or a drafter)."""

    sessions: SessionStore

    def end_session(self, session_id: str, keep: bool = True) -> bool: ...

    def describe(self) -> ModelDescription: ...


class SessionServicerMixin:
    """Expects `_runner` and `_model_thread` on the servicer."""

    _runner: SessionRunner
    _model_thread: ModelThread

    @grpc_errors
    async def EndSession(
        self, request: common_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EndSessionResponse:
        committed = request.committed_tokens if request.HasField("committed_tokens") else None
        ended = request.session_id, request.discard, request.epoch, committed
        existed = await self._model_thread.run_brief(self._end_session, *ended)
        return common_pb2.EndSessionResponse(existed=existed)

    def _end_session(self, session_id: str, discard: bool, epoch: int, committed: int | None) -> bool:
        """On the model thread: the session's calls numbered up to `epoch` open nothing from now
        on (SessionStore.retire), and the session ends, its output no more than `committed` of
        its caller's tokens (EndSessionRequest.committed_tokens)."""
        self._runner.sessions.retire(session_id, epoch)
        session = self._runner.sessions.peek(session_id)
        if session is not None and committed is not None:
            positions = session.caller_positions  # a bridged draft's own tokens by the caller's
            own = positions[min(committed, len(positions) - 1)] if positions else committed
            held = len(session.tokens) if session.committed_tokens is None else session.committed_tokens
            session.committed_tokens = min(held, own)
        return self._runner.end_session(session_id, not discard)

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return wire.description_to_pb(await self._model_thread.run_brief(self._runner.describe))


async def answer_each(
    requests: AsyncIterator[Any], answer: Callable[[Any], Awaitable[Any]], reply_type: type, field: str
) -> AsyncIterator[Any]:
    """A call stream's replies (Draft.ProposeStream, Target.VerifyStream): each request is one
    call, answered in order with `reply_type(field=answer(request))` or, when the call fails,
    with its status code inside the reply, so one bad call does not end the stream. A cancelled
    stream cancels the call in progress, as cancelling a unary call does."""
    async for request in requests:
        try:
            reply = reply_type(**{field: await answer(request)})
        except Exception as exc:  # noqa: BLE001 - answered inside the reply
            reply = reply_type(**error_fields(exc))
        yield reply
