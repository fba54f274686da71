"""The RPCs the draft and target services share: EndSession and Info, and answering a call
stream."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

from specdec.engine.calls import ModelDescription
from specdec.engine.sessions import SessionStore
from specdec.errors import error_fields, grpc_errors
from specdec.rpc import wire
from specdec.rpc.model_thread import ModelThread
from specdec.v1 import common_pb2

# A session used this recently may be mid-request: between two of its calls here come the
# other service's (a long prompt's prefill on a CPU draft takes seconds).
MID_REQUEST_S = 5.0


class SessionRunner(Protocol):
    """What EndSession and Info need of a service's runner (a model runner or a drafter)."""

    sessions: SessionStore

    def end_session(self, session_id: str, keep: bool = True) -> bool: ...

    def describe(self) -> ModelDescription: ...


class SessionServicerMixin:
    """Expects `_runner` and `_model_thread` on the servicer."""

    _runner: SessionRunner
    _model_thread: ModelThread

    @functools.cached_property
    def streams(self) -> Streams:
        return Streams()

    async def end_idle_streams(self) -> None:
        """A drain while the server stops: once no session here has been used for MID_REQUEST_S,
        no request in flight needs the call streams its callers keep open, so those waiting for
        a next call end (a caller opens a fresh one when it calls again) and the server stops
        without sitting out its grace. (Sessions stay open after their requests: a stopping
        server refuses the EndSession calls.) Until then they stay open, at most until the
        grace ends, when gRPC cancels every stream and this returns."""
        while self.streams.open:
            if not self._runner.sessions.active(MID_REQUEST_S):
                self.streams.end_idle()
            await asyncio.sleep(0.05)

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


class Streams:
    """A servicer's open call streams (`answer_each`): each one's task, and whether it is
    waiting for its next call (idle) rather than answering one."""

    def __init__(self) -> None:
        self.open: dict[asyncio.Task, bool] = {}
        self.ending: set[asyncio.Task] = set()

    def end_idle(self) -> None:
        """Ends the streams waiting for a next call: their read is cancelled, and each ends
        as a stream its caller closed (OK), not as a failed call."""
        for task, idle in list(self.open.items()):
            if idle and task not in self.ending:
                self.ending.add(task)
                task.cancel()


async def answer_each(
    requests: AsyncIterator[Any],
    answer: Callable[[Any], Awaitable[Any]],
    reply_type: type,
    field: str,
    streams: Streams,
) -> AsyncIterator[Any]:
    """A call stream's replies (Draft.ProposeStream, Target.VerifyStream): each request is one
    call, answered in order with `reply_type(field=answer(request))` or, when the call fails,
    with its status code inside the reply, so one bad call does not end the stream. A cancelled
    stream cancels the call in progress, as cancelling a unary call does. The stream's task is
    in `streams` while it is open, marked idle between calls (`end_idle_streams`)."""
    task = asyncio.current_task()
    assert task is not None
    iterator = aiter(requests)
    try:
        while True:
            streams.open[task] = True
            try:
                request = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if task not in streams.ending:
                    raise
                task.uncancel()  # ended while idle (`Streams.end_idle`): as if its caller closed it
                return
            streams.open[task] = False
            try:
                reply = reply_type(**{field: await answer(request)})
            except Exception as exc:  # noqa: BLE001 - answered inside the reply
                reply = reply_type(**error_fields(exc))
            yield reply
    finally:
        streams.open.pop(task, None)
        streams.ending.discard(task)
