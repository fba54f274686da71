"""Draft gRPC servicer: protobuf ↔ runner calls, nothing else."""

from __future__ import annotations

import asyncio
import threading

import grpc

from draft_service.ngram import NgramDrafter
from draft_service.runner import DraftRunner
from specdec import wire
from specdec.errors import grpc_errors
from specdec.servicer_base import SessionServicerMixin
from specdec.serving import ModelThread
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicerMixin, draft_pb2_grpc.DraftServicer):
    def __init__(self, runner: DraftRunner | NgramDrafter, model_thread: ModelThread) -> None:
        self._runner = runner
        self._model_thread = model_thread

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        stop = threading.Event()
        try:
            proposal = await self._model_thread.run(
                self._runner.propose,
                request.session_id,
                request.keep_tokens,
                list(request.new_tokens),
                request.num_tokens,
                wire.params_from_pb(request.sampling),
                request.seed,
                request.epoch,
                stop.is_set,
                request.fork_from,
            )
        except asyncio.CancelledError:
            stop.set()  # the client cancelled: stop drafting at the next step
            raise
        return draft_pb2.ProposeResponse(
            token_ids=proposal.token_ids,
            distributions=wire.encode_distributions(proposal.probs, len(proposal.token_ids), proposal.deterministic),
            processed_tokens=proposal.processed_tokens,
            sequence_length=proposal.sequence_length,
            compute_ms=proposal.compute_ms,
            runner_up_token_ids=proposal.runner_up_ids,
            runner_up_probs=proposal.runner_up_probs,
        )
