"""Target gRPC servicer: protobuf ↔ runner calls, nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from specdec.engine.features import feature_dtype, joined_features
from specdec.errors import InvalidArgument, grpc_errors
from specdec.rpc import wire
from specdec.rpc.model_thread import ACTIVE_SESSION_S, CallBatcher, ModelThread
from specdec.rpc.servicer_base import SessionServicerMixin, answer_each
from specdec.rpc.telemetry import ModelServiceMetrics, context_of, traced_span
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.runner import TargetRunner, Verification, VerifyCall, next_step

T = TypeVar("T")


class TargetServicer(SessionServicerMixin, target_pb2_grpc.TargetServicer):
    _runner: TargetRunner

    def __init__(
        self,
        runner: TargetRunner,
        model_thread: ModelThread,
        metrics: ModelServiceMetrics | None = None,
        batch_window_s: float = 0.0,
        max_batch_size: int = 1,
    ) -> None:
        """`batch_window_s` > 0 and `max_batch_size` > 1: concurrent Verify calls from different
        sessions share forward passes (TargetRunner.verify_batch); otherwise each runs alone."""
        self._runner = runner
        self._model_thread = model_thread
        self._metrics = metrics
        # No call waits for a session that is not open: once every open session has a call
        # waiting (one generation alone, or all of them in lockstep), the batch starts.
        self._batcher: CallBatcher[VerifyCall, Verification] | None = (
            CallBatcher(
                model_thread,
                runner.verify_batch,
                batch_window_s,
                max_batch_size,
                more_expected=lambda waiting: runner.sessions.active(ACTIVE_SESSION_S) > waiting,
            )
            if batch_window_s > 0 and max_batch_size > 1
            else None
        )

    @grpc_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await self._answer(request)

    @grpc_errors
    async def VerifyStream(
        self, requests: AsyncIterator[target_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyResult]:
        """Verify calls as stream messages (the coordinator's hot path), each answered alone."""
        async for reply in answer_each(requests, self._answer, target_pb2.VerifyResult, "response", self.streams):
            yield reply

    async def _answer(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        draft_token_ids = list(request.draft_token_ids)
        if request.step_seeds and (draft_token_ids or request.return_distributions):
            raise InvalidArgument("step_seeds need a target-only call: no draft tokens, no return_distributions")
        if len(request.step_seeds) > wire.MAX_STEP_SEEDS:
            raise InvalidArgument(f"at most {wire.MAX_STEP_SEEDS} step_seeds; got {len(request.step_seeds)}")
        if request.step_seeds:  # every step's token must fit, or none runs
            self._runner.check_length(request.keep_tokens + len(request.new_tokens) + len(request.step_seeds))
        params = wire.params_from_pb(request.sampling)
        relaxed = wire.relaxed_from_pb(request)
        top_logprobs = wire.top_logprobs_from_pb(request)
        features_dtype = feature_dtype(request.feature_dtype) if request.feature_layers else None
        # Width 0 still checks the messages' structure but builds no [K, V] rows.
        needed = self._runner.needs_draft_probs(params, request.return_distributions)
        vocab = self._runner.loaded.vocab_size if needed else 0
        draft_probs = wire.decode_distributions(list(request.draft_distributions), draft_token_ids, vocab)
        stop = threading.Event()
        with traced_span("target.verify", context_of(request.trace_context)) as span:
            span.set_attributes(
                {
                    "specdec.session_id": request.session_id,
                    "specdec.keep_tokens": request.keep_tokens,
                    "specdec.new_tokens": len(request.new_tokens),
                    "specdec.draft_tokens": len(draft_token_ids),
                }
            )
            call = VerifyCall(
                request.session_id,
                request.keep_tokens,
                list(request.new_tokens),
                draft_token_ids,
                draft_probs,
                params,
                request.seed,
                request.return_distributions,
                tuple(request.draft_parents),
                request.cache_namespace,
                relaxed,
                top_logprobs,
                max(0, request.output_start),
                tuple(request.feature_layers),
                should_stop=stop.is_set,
            )
            try:
                steps, step_logprobs, result = await self._steps(request, call)
            except asyncio.CancelledError:
                stop.set()  # the client cancelled: a prefill batched with others stops at its next pass
                raise
            span.set_attributes(
                {
                    "specdec.processed_tokens": result.processed_tokens,
                    "specdec.cache_length": result.sequence_length,
                    "specdec.forward_ms": result.compute_ms,
                    "specdec.batch_size": result.batch_size,
                }
            )
        if self._metrics is not None:
            self._metrics.observe_call("verify", result.compute_ms, result.processed_tokens, result.batch_size)
        return target_pb2.VerifyResponse(
            draft_token_target_probs=result.draft_token_target_probs,
            recovered_token_ids=result.recovered_token_ids,
            bonus_token_id=result.bonus_token_id,
            target_distributions=[wire.encode_dense(row) for row in result.target_probs]
            if result.target_probs is not None
            else [],
            processed_tokens=result.processed_tokens,
            sequence_length=result.sequence_length,
            compute_ms=result.compute_ms,
            step_token_ids=steps,
            relaxed_accepts=result.relaxed_accepts,
            draft_token_logprobs=result.logprobs.draft if result.logprobs is not None else [],
            row_logprobs=wire.token_logprobs_to_pb(result.logprobs),
            step_logprobs=step_logprobs,
            features=None
            if result.features is None or features_dtype is None
            else wire.features_to_pb(result.sequence_length - result.processed_tokens, result.features, features_dtype),
            held_sessions=self._runner.sessions.held(),
        )

    async def _verify(self, call: VerifyCall) -> Verification:
        if self._batcher is not None:
            return await self._batcher.submit(call)
        return await self._model_thread.run(self._runner.verify_one, call)

    async def _steps(
        self, request: target_pb2.VerifyRequest, first: VerifyCall
    ) -> tuple[list[int], list[common_pb2.TokenLogprobs], Verification]:
        """`first`, then VerifyRequest.step_seeds: each step a target-only call of its own after
        the one before, feeding the last token and drawing the next with its seed. Returns the
        steps' tokens, their log-probabilities (VerifyRequest.return_logprobs), and the first
        call's result (its bonus token) with their work and the session's length added.

        A session decoding alone runs the call and its steps in one job of the model thread
        (TargetRunner.verify_then_steps: one hop of the thread, not two), which yields as soon
        as another call waits; otherwise each goes through the batcher, so other sessions'
        calls share its passes."""
        steps: list[Verification] = []
        stops = set(request.stop_token_ids)
        seeds = list(request.step_seeds)
        if seeds and self._alone():
            result, steps = await self._in_one_job(self._runner.verify_then_steps, first, seeds, stops)
        else:
            result = await self._verify(first)
        while len(steps) < len(seeds) and (last := steps[-1] if steps else result).bonus_token_id not in stops:
            rest = seeds[len(steps) :]
            if self._alone():
                steps += await self._in_one_job(self._runner.verify_steps, first, last, rest, stops)
            else:
                steps.append(await self._verify(next_step(first, last, rest[0])))
        if not steps:
            return [], [], result
        step_logprobs = [entry for step in steps for entry in wire.token_logprobs_to_pb(step.logprobs)]
        return (
            [step.bonus_token_id for step in steps],
            step_logprobs,
            dataclasses.replace(
                result,
                sequence_length=steps[-1].sequence_length,
                compute_ms=result.compute_ms + sum(step.compute_ms for step in steps),
                processed_tokens=result.processed_tokens + sum(step.processed_tokens for step in steps),
                features=joined_features(result.features, [step.features for step in steps]),
            ),
        )

    def _alone(self) -> bool:
        """No other session decodes now: nothing would share this session's passes."""
        return self._batcher is None or self._runner.sessions.active(ACTIVE_SESSION_S) <= 1

    async def _in_one_job(self, steps_fn: Callable[..., T], *args: Any) -> T:
        """`steps_fn(*args, yield_now)` on the model thread, `yield_now` saying that another
        call waits or that this one was cancelled (the job runs on; it stops at its next step)."""
        cancelled = threading.Event()
        try:
            return await self._model_thread.run(
                steps_fn, *args, lambda: cancelled.is_set() or self._model_thread.queued()
            )
        except asyncio.CancelledError:
            cancelled.set()
            raise
