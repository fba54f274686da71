"""Draft gRPC servicer: protobuf ↔ runner calls, nothing else."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from draft_service.drafter import Drafter, Proposal, ProposeCall
from specdec.errors import InvalidArgument, error_fields, grpc_errors
from specdec.rpc import wire
from specdec.rpc.model_thread import ACTIVE_SESSION_S, CallBatcher, ModelThread
from specdec.rpc.servicer_base import SessionServicerMixin, answer_each
from specdec.rpc.telemetry import ModelServiceMetrics, context_of, traced_span
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionServicerMixin, draft_pb2_grpc.DraftServicer):
    _runner: Drafter

    def __init__(
        self,
        runner: Drafter,
        model_thread: ModelThread,
        metrics: ModelServiceMetrics | None = None,
        batch_window_s: float = 0.0,
        max_batch_size: int = 1,
    ) -> None:
        """`batch_window_s` > 0 and `max_batch_size` > 1: concurrent Propose calls from
        different sessions step together (DraftRunner.propose_batch); otherwise each runs alone.
        The prompt-lookup drafter has no model pass to share and always runs calls alone."""
        self._runner = runner
        self._model_thread = model_thread
        self._metrics = metrics
        # As on the target: no call waits for a session that has no call coming.
        self._batcher: CallBatcher[ProposeCall, Proposal] | None = (
            CallBatcher(
                model_thread,
                runner.propose_batch,
                batch_window_s,
                max_batch_size,
                more_expected=lambda waiting: runner.sessions.active(ACTIVE_SESSION_S) > waiting,
                answers_early=True,
                joins=True,
            )
            if batch_window_s > 0 and max_batch_size > 1 and runner.shares_passes
            else None
        )

    @grpc_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        return await self._answer(request)

    @grpc_errors
    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.BranchResult]:
        """Propose calls as stream messages (the coordinator's hot path), each answered alone."""
        async for reply in answer_each(requests, self._answer, draft_pb2.BranchResult, "proposal", self.streams):
            yield reply

    async def _answer(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        with traced_span("draft.propose", context_of(request.trace_context)) as span:
            span.set_attributes(
                {
                    "specdec.session_id": request.session_id,
                    "specdec.keep_tokens": request.keep_tokens,
                    "specdec.new_tokens": len(request.new_tokens),
                    "specdec.num_tokens": request.num_tokens,
                    "specdec.epoch": request.epoch,
                    "specdec.fork": bool(request.fork_from),
                }
            )
            proposal = await self._propose(request)
            span.set_attributes(
                {
                    "specdec.proposed": len(proposal.token_ids),
                    "specdec.processed_tokens": proposal.processed_tokens,
                    "specdec.cache_length": proposal.sequence_length,
                    "specdec.forward_ms": proposal.compute_ms,
                    "specdec.batch_size": proposal.batch_size,
                }
            )
        if self._metrics is not None:
            self._metrics.observe_call("propose", proposal.compute_ms, proposal.processed_tokens, proposal.batch_size)
        return _response(proposal, self._runner.sessions.held())

    @grpc_errors
    async def ProposeBranches(
        self, request: draft_pb2.ProposeBranchesRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeBranchesResponse:
        return await self._branches(request)

    @grpc_errors
    async def ProposeBranchesStream(
        self, requests: AsyncIterator[draft_pb2.ProposeBranchesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeBranchesResult]:
        """ProposeBranches calls as stream messages (the coordinator's hot path), each answered alone."""
        async for reply in answer_each(
            requests, self._branches, draft_pb2.ProposeBranchesResult, "response", self.streams
        ):
            yield reply

    async def _branches(self, request: draft_pb2.ProposeBranchesRequest) -> draft_pb2.ProposeBranchesResponse:
        """The branches' draft steps share forward passes with each other and, through the
        batcher, with every other session's calls (`_propose_branches`)."""
        if not 1 <= len(request.branches) <= wire.MAX_BRANCHES:
            raise InvalidArgument(
                f"ProposeBranches takes 1 to {wire.MAX_BRANCHES} branches; got {len(request.branches)}"
            )
        ending = list(request.end_session_ids)
        if len(ending) > wire.MAX_ENDED_SESSIONS:
            raise InvalidArgument(f"ProposeBranches ends at most {wire.MAX_ENDED_SESSIONS} sessions; got {len(ending)}")
        named = {b.session_id for b in request.branches} | {b.fork_from for b in request.branches}
        if clash := next((session for session in ending if session in named), None):
            raise InvalidArgument(f"end_session_ids names {clash!r}, which a branch of the same call uses")
        with traced_span("draft.propose_branches", context_of(request.trace_context)) as span:
            span.set_attributes(
                {
                    "specdec.branches": len(request.branches),
                    "specdec.forks": sum(bool(b.fork_from) for b in request.branches),
                    "specdec.num_tokens": max(b.num_tokens for b in request.branches),
                }
            )
            stop = threading.Event()
            calls = [_call(branch, stop.is_set) for branch in request.branches]
            try:
                results = await self._propose_branches(ending, calls)
            except asyncio.CancelledError:
                stop.set()  # the verify went another way: stop every branch at its next step
                raise
        reply, held = draft_pb2.ProposeBranchesResponse(), self._runner.sessions.held()
        for result in results:
            if isinstance(result, Exception):
                reply.results.add(**error_fields(result))
            else:
                if self._metrics is not None:
                    self._metrics.observe_call("propose", result.compute_ms, result.processed_tokens, result.batch_size)
                reply.results.add(proposal=_response(result, held))
        return reply

    async def _propose_branches(self, ending: list[str], calls: list[ProposeCall]) -> list:
        """Ends the sessions the caller is done with, then drafts the branches: per branch, its
        proposal or the exception it failed with.

        With a batcher, each branch is a call of its own, all submitted at once in the
        request's order: they join the decode batch running for other sessions, or start the
        next one together (the runner orders a fork and a call on its parent as listed). A
        pipelined round's pre-draft thus steps beside every other session's drafts, where a job
        of its own on the model thread would end the running batch and step alone: with one
        draft serving many sessions, every round's pre-draft then ran solo passes, one after
        another."""
        if self._batcher is None:
            return await self._model_thread.run(self._end_then_propose, ending, calls)
        if ending:
            await self._model_thread.run_brief(self._end_sessions, ending, _before(calls))
        return await self._batcher.submit_all(calls)

    def _end_then_propose(self, ending: list[str], calls: list[ProposeCall]) -> list:
        """On the model thread: ends the sessions the caller is done with, then drafts the branches."""
        self._end_sessions(ending, _before(calls))
        return self._runner.propose_batch(calls)

    def _end_sessions(self, ending: list[str], epoch: int) -> None:
        """Unused branches of earlier calls, numbered up to `epoch`: their sequences are no
        output to learn from, and a call of theirs still queued forks nothing."""
        for session_id in ending:
            self._runner.sessions.retire(session_id, epoch)
            self._runner.sessions.end(session_id)

    async def _propose(self, request: draft_pb2.ProposeRequest):
        stop = threading.Event()
        call = _call(request, stop.is_set)
        try:
            if self._batcher is not None:
                return await self._batcher.submit(call)
            return await self._model_thread.run(self._runner.propose_one, call)
        except asyncio.CancelledError:
            stop.set()  # the client cancelled: stop drafting at the next step
            raise


def _before(calls: list[ProposeCall]) -> int:
    """The newest call number before a ProposeBranches call's own (0: it numbers none)."""
    return max(0, min(call.epoch for call in calls) - 1)


def _call(request: draft_pb2.ProposeRequest, should_stop) -> ProposeCall:
    if request.runner_ups > wire.MAX_RUNNER_UPS:
        raise InvalidArgument(f"runner_ups must be in [0, {wire.MAX_RUNNER_UPS}] (0 means 1); got {request.runner_ups}")
    if request.guess_rank > wire.MAX_RUNNER_UPS or request.guess_rank and not request.guess_first:
        raise InvalidArgument(
            f"guess_rank must be in [0, {wire.MAX_RUNNER_UPS}], and 0 without guess_first; got {request.guess_rank}"
        )
    return ProposeCall(
        request.session_id,
        request.keep_tokens,
        list(request.new_tokens),
        request.num_tokens,
        wire.params_from_pb(request.sampling),
        request.seed,
        request.epoch,
        should_stop,
        request.fork_from,
        request.min_confidence if request.HasField("min_confidence") else None,
        request.vocab_limit,
        request.max_copied_tokens if request.HasField("max_copied_tokens") else None,
        tuple(request.tree_widths),
        request.guess_first,
        request.cache_namespace,
        request.own_sequence_only,
        max(request.runner_ups, 1),
        request.guess_rank,
        wire.features_from_pb(request.features) if request.HasField("features") else None,
    )


def _response(proposal, held_sessions: int) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        token_ids=proposal.token_ids,
        distributions=wire.encode_distributions(
            proposal.probs, len(proposal.token_ids), proposal.deterministic, proposal.supports
        ),
        processed_tokens=proposal.processed_tokens,
        sequence_length=proposal.sequence_length,
        compute_ms=proposal.compute_ms,
        runner_up_token_ids=proposal.runner_up_ids,
        runner_up_probs=proposal.runner_up_probs,
        copied=proposal.copied,
        parents=proposal.parents,
        held_sessions=held_sessions,
    )
