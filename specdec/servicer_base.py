"""The RPCs the draft and target services share: EndSession and Info."""

from __future__ import annotations

import grpc

from specdec import wire
from specdec.errors import grpc_errors
from specdec.runner import ModelRunner
from specdec.serving import ModelThread
from specdec.v1 import common_pb2


class SessionServicerMixin:
    """Expects `_runner` (a ModelRunner) and `_model_thread` on the servicer."""

    _runner: ModelRunner
    _model_thread: ModelThread

    @grpc_errors
    async def EndSession(
        self, request: common_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EndSessionResponse:
        existed = await self._model_thread.run(self._runner.end_session, request.session_id)
        return common_pb2.EndSessionResponse(existed=existed)

    @grpc_errors
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return wire.description_to_pb(await self._model_thread.run(self._runner.describe))
