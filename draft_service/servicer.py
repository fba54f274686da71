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
from specdec.telemetry import ModelServiceMetrics, tracer
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicerMixin, draft_pb2_grpc.DraftServicer):
    def __init__(self, runner: DraftRunner | NgramDrafter, model_thread: ModelThread, metrics: ModelServiceMetrics | None = None) -> None:
        self._runner = runner
        self._model_thread = model_thread
        self._metrics = metrics

    @grpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        with tracer.start_as_current_span("draft.propose") as span:
            span.set_attributes({
                "specdec.session_id": request.session_id, "specdec.keep_tokens": request.keep_tokens,
                "specdec.new_tokens": len(request.new_tokens), "specdec.num_tokens": request.num_tokens,
                "specdec.epoch": request.epoch, "specdec.fork": bool(request.fork_from),
            })
            proposal = await self._propose(request)
            span.set_attributes({
                "specdec.proposed": len(proposal.token_ids), "specdec.processed_tokens": proposal.processed_tokens,
                "specdec.cache_length": proposal.sequence_length, "specdec.forward_ms": proposal.compute_ms,
            })
        if self._metrics is not None:
            self._metrics.observe_call("propose", proposal.compute_ms, proposal.processed_tokens)
        return draft_pb2.ProposeResponse(
            token_ids=proposal.token_ids,
            distributions=wire.encode_distributions(proposal.probs, len(proposal.token_ids), proposal.deterministic),
            processed_tokens=proposal.processed_tokens,
            sequence_length=proposal.sequence_length,
            compute_ms=proposal.compute_ms,
            runner_up_token_ids=proposal.runner_up_ids,
            runner_up_probs=proposal.runner_up_probs,
        )

    async def _propose(self, request: draft_pb2.ProposeRequest):
        stop = threading.Event()
        try:
            return await self._model_thread.run(
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
