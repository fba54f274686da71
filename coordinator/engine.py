"""The generation engine: each request's rounds, as plan → run → settle → commit.

`coordinator.rounds` holds the round's plan and draws, `coordinator.commit` the commit that is
the one writer of a request's state, `coordinator.acceptance` each mode's acceptance rule,
`coordinator.upstream` the calls to the services (retries, breaker, re-prefill),
`coordinator.branches` the pre-drafts and hedges drafted during a verify. This module runs a
request through them and yields its text as rounds commit it.

Each round sends each service only what it has not seen: the service keeps the session's
sequence and KV cache, and the coordinator tracks how much of it is still valid (`synced`).
A service that lost the session (restart, expiry) answers NOT_FOUND and is re-sent the whole
committed sequence, so no request fails because of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span
from transformers import PreTrainedTokenizerBase

from coordinator.acceptance import check_verification, decide, round_mode
from coordinator.branches import BranchCall, Branches
from coordinator.choosers import Choosers
from coordinator.commit import RoundResult, commit_round
from coordinator.config import CoordinatorConfig
from coordinator.drafting import Drafting
from coordinator.hedging import runner_ups_for
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo
from coordinator.pools import Pool
from coordinator.requests import Chunk, GenerationRequest, Job, prepare_job
from coordinator.rounds import (
    DEFAULT_RULES,
    RequestState,
    RoundDraws,
    RoundPlan,
    RoundRules,
    draw_round,
    plan_round,
)
from coordinator.state import RetryWindow, RoundRecord, SessionView
from coordinator.text import TextAssembler
from coordinator.upstream import Upstream, verify_fields
from specdec.rpc import wire
from specdec.rpc.telemetry import traced_span
from specdec.sampling.relaxed import AcceptanceMode
from specdec.sampling.seeds import RequestStreams
from specdec.v1 import common_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    """Runs requests: validation (coordinator.requests) on the requests thread, then rounds."""

    def __init__(
        self,
        config: CoordinatorConfig,
        drafts: Pool,
        targets: Pool,
        tokenizer: PreTrainedTokenizerBase,
        pair: PairInfo,
        target_info: common_pb2.ModelInfo,
        rules: RoundRules = DEFAULT_RULES,
    ) -> None:
        self.config = config
        self.rules = rules
        self.tokenizer = tokenizer
        self.upstream = Upstream(config, drafts, targets, pair, target_info)
        self.branches = Branches(self.upstream)
        self.drafting = Drafting(self.upstream, self.branches)
        self.choosers = Choosers(config, rules)
        # Validation, chat templating and tokenising run here, one request at a time (as vLLM's
        # tokenizer thread), never on the event loop: a large request costs its own latency, not
        # a stall of every stream in flight.
        self._requests_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="requests")

    @property
    def pair(self) -> PairInfo:
        """The pair as last read from both services' Info (a restarted draft may change it)."""
        return self.upstream.pair

    def prepare(self, request: GenerationRequest, pair: PairInfo) -> Job:
        """Validates a request (coordinator.requests) against the request's snapshot of the pair."""
        return prepare_job(request, self.config, pair, self.tokenizer)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the requests thread: request handling that grows with the request's size."""
        return await asyncio.get_running_loop().run_in_executor(self._requests_thread, fn, *args)

    def close(self) -> None:
        self.upstream.close()
        self._requests_thread.shutdown(wait=False, cancel_futures=True)

    async def wait_cleanup(self) -> None:
        """Until every session end already started has finished (before the services stop)."""
        await self.upstream.wait_cleanup()

    async def generate(
        self, request: GenerationRequest, time_remaining_s: float | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Yields one chunk per round; the last carries the finish reason and the stats.

        Sequential mode drafts, then verifies. Pipelined mode (`--pipeline`) also starts a
        pre-draft during each verify: the draft continues as if every draft token will be
        accepted. It is used only when the whole round was accepted and its first token e1
        equals the target's bonus token b; then e2.. become the next round's drafts, each
        drawn from the draft's distribution given exactly the committed prefix (which ends
        in b). Why that stays exact: rejection sampling returns the target's distribution
        for any proposal that was drawn from the distribution sent with it, independently of
        the target's coins. e2.. were drawn before the next round's uniforms and target
        samples exist, the rule that selects them (`Branches.pick`) looks only at the finished
        round and e1, and the next round verifies them against the distributions they came
        from. Any other outcome cancels the pre-draft and its tokens are never read.

        With catch-up steps (`RoundRules.catch_up`), a pipelined round with no drafts ready is one
        target-only step while a pre-draft catches the draft session up, guesses that step's
        token and drafts on; the same rule keeps it. Hedged mode (`--hedges N`) also forks the
        draft session for the N likeliest rejection outcomes (coordinator.hedging); a fork is
        used only when the round ended exactly as it assumed, so the same argument applies.
        Which kind a round is depends on earlier outcomes and the costs calibrated at start-up
        (`plan_round`), never on a time measured during the request, so a seed maps to one
        output on one running deployment.
        """
        pair, received = self.pair, time.perf_counter()  # the request's snapshot, from validation to its last round
        state = await self._start(await self.off_loop(self.prepare, request, pair), pair, time_remaining_s, received)
        branches: BranchCall | None = None  # drafted during the verify, until the outcome settles them
        try:
            while True:
                attributes = {"specdec.round.index": state.round_index}
                with traced_span("round", attributes=attributes) as span:
                    started = state.stats.elapsed_ms()
                    work_before = state.stats.work_marks()
                    draft_allowed = self.upstream.draft_allowed(state.draft_view, state.unused_forks)
                    costs, copy_costs = self.choosers.costs_at_load(state)
                    plan = plan_round(
                        state, self.rules.catch_up, draft_allowed, self.config.target_only_steps, costs, copy_costs
                    )
                    draws = draw_round(state.streams, plan)
                    result, branches = await self._run_round(state, plan, draws)
                    settled = None
                    if branches is not None:
                        settled = await self.drafting.settle(state, branches, result)
                        branches = None
                    record = commit_round(state, plan, result, settled)
                    state.stats.observe(record)
                    self._close_round(state, span, started, work_before, record, plan)
                delta = record.delta  # spans end before yielding: the caller runs between rounds
                if record.finished:
                    yield self._finish(state, record)
                    return
                yield Chunk(delta.token_ids, delta.text, logprobs=delta.logprobs)
        finally:
            if branches is not None:
                self.branches.drop(branches)
            self.branches.end_now(state.unused_forks, state.draft_view)
            self.upstream.end_sessions(state.draft_view, state.target_view)

    def _finish(self, state: RequestState, record: RoundRecord) -> Chunk:
        """The last chunk: the last round's text, the finish reason and the request's stats
        (its priors carried to the next request: `Choosers.learn`)."""
        stats, delta = state.stats, record.delta
        stats.close(len(state.text.token_ids))
        stats.target_replica = state.target_view.address
        stats.draft_replica = state.draft_view.address if state.draft_view.replica else ""
        stats.replica_moves = state.target_view.moves + state.draft_view.moves
        self.choosers.learn(state)
        return Chunk(delta.token_ids, delta.text, state.text.finish_reason, stats, delta.logprobs)

    async def _start(self, job: Job, pair: PairInfo, time_remaining_s: float | None, received: float) -> RequestState:
        """A request's state before its first round, its sessions placed (after waiting for
        room on a target replica, if every one is full); its clock runs from `received`
        (perf_counter), before it was prepared (tokenised, templated: in turn on one thread)."""
        # Give up on an unavailable target, or waiting for room, in time to tell the client so
        # before its own deadline.
        now, wait_for = asyncio.get_running_loop().time(), self.config.queue_timeout_s
        retry = RetryWindow(self.config.connect_timeout_s)
        if time_remaining_s is not None:
            time_remaining_s -= time.perf_counter() - received
            wait_for = min(wait_for, 0.7 * time_remaining_s)
            retry = dataclasses.replace(retry, until=now + 0.7 * time_remaining_s)
        session_id = uuid.uuid4().hex
        overlap = self.choosers.overlap(job, pair)
        k_chooser = self.choosers.k_chooser(job, pair, overlap)
        stats = GenerationStats(
            prompt_tokens=len(job.prompt_ids),
            target_numerics=pair.target_numerics,
            pipelined=overlap.pipelined,
            acceptance_mode=job.acceptance_mode.value,
            relaxed_top_n=job.relaxed.top_n if job.relaxed is not None else 0,
            relaxed_delta=job.relaxed.delta if job.relaxed is not None else 0.0,
            _start=received,
        )
        draft_view = SessionView(
            session_id,
            min_confidence=job.draft_min_confidence,
            vocab_limit=pair.draft_vocab_limit,
            namespace=job.cache_namespace,
            # A seeded sampled request's proposals, like its K, may depend on nothing but itself.
            own_sequence_only=job.seeded_sampled,
            runner_ups=runner_ups_for(overlap.hedges),
        )
        target_view = SessionView(session_id, namespace=job.cache_namespace)
        # Whatever can refuse the request does so before it holds a place (a place is freed
        # only by the request's end, which a request that never started never reaches).
        state = RequestState(
            job=job,
            pair=pair,
            stats=stats,
            streams=RequestStreams.of(job.seed),
            sampling=wire.params_to_pb(job.params),
            sequence=list(job.prompt_ids),
            text=TextAssembler(self.tokenizer, job.prompt_ids, set(pair.eos_token_ids), job.stop, job.max_new_tokens),
            draft_view=draft_view,
            target_view=target_view,
            overlap=overlap,
            retry=retry,
            k_chooser=k_chooser,
            copy_chooser=self.choosers.copy_chooser(k_chooser, job, pair),
            # A seeded sampled request's K may depend on nothing but itself (its seed's output
            # depends on K); greedy output is the target's whatever K is.
            load_aware=not job.seeded_sampled,
        )
        waited_s = await self.upstream.place(draft_view, target_view, job.prompt_ids, job.max_new_tokens, wait_for)
        stats.queued_ms = waited_s * 1000
        if waited_s:
            trace.get_current_span().add_event("queued", {"specdec.queued_ms": stats.queued_ms})
        return state

    async def _run_round(
        self, state: RequestState, plan: RoundPlan, draws: RoundDraws
    ) -> tuple[RoundResult, BranchCall | None]:
        """The round's calls: its drafts (ready, or a draft call that may fall back to none),
        the verify, and the branches drafted while it runs; then the outcome, decided."""
        pair = state.pair
        drafted = await self.drafting.draft(state, plan, draws)
        round_ = drafted.round
        mode = round_mode(state.job, round_)
        job = state.job
        fields = verify_fields(
            round_,
            state.sampling,
            draws.target_seed,
            draws.step_seeds,
            pair.eos_token_ids if draws.step_seeds else (),
            job.relaxed if mode is AcceptanceMode.RELAXED else None,
            job.top_logprobs,
            len(job.prompt_ids),
            pair.feature_layers,
        )
        verify = asyncio.ensure_future(
            self.upstream.verify(state.target_view, state.sequence, fields, state.stats, state.retry)
        )
        branches = None
        try:
            branches = self.drafting.start_branches(state, plan, draws, round_)
            if branches is None:  # no branch call to carry the unused forks: end them now
                self.branches.end_now(state.unused_forks, state.draft_view)
            verification = await verify
            if branches is not None:
                branches.verified_ms = state.stats.elapsed_ms()
            check_verification(
                state.target_view.address, pair, round_, verification, len(draws.step_seeds), mode, state.job
            )
        except BaseException:
            if branches is not None:
                self.branches.drop(branches)
            raise
        finally:
            if not verify.done():
                verify.cancel()
        state.stats.target_compute_ms += verification.compute_ms
        outcome = decide(round_, verification, draws.uniforms, mode)
        result = RoundResult(
            round_, verification, outcome, drafted.took, drafted.refused, drafted.pair, drafted.features_end
        )
        return result, branches

    def _close_round(
        self,
        state: RequestState,
        span: Span,
        started: float,
        work_before: tuple[float, float, float],
        record: RoundRecord,
        plan: RoundPlan,
    ) -> None:
        """The round's timings and its span's attributes. A target-only call's further steps
        each count as a round (`GenerationStats.observe`), so its time is shared out among them
        evenly: one figure a round, as `k_per_round` has."""
        stats = state.stats
        stats.mark_first_token()
        rounds = 1 + record.steps
        whole_ms = stats.elapsed_ms() - started
        overhead_ms = whole_ms - stats.work_ms_since(work_before)
        stats.round_ms += [whole_ms / rounds] * rounds
        stats.round_overhead_ms += [overhead_ms / rounds] * rounds
        span.set_attributes(
            {
                "specdec.round.k": record.proposed,
                "specdec.round.accepted": record.accepted,
                "specdec.round.next_token": "bonus" if record.bonus else "recovered",
                "specdec.round.drafts_from": record.source.value,
                "specdec.round.epoch": state.draft_view.last_epoch,
                "specdec.round.pipelined": plan.overlapping,
                "specdec.round.target_replica": state.target_view.address,
                "specdec.round.draft_replica": state.draft_view.address,
            }
        )
