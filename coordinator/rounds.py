"""The generation loop: draft proposes, target verifies, the coordinator accepts or rejects.

Each round sends each service only what it has not seen: the service keeps the session's
sequence and KV cache, and the coordinator tracks how much of it is still valid (`synced`).
A service that lost the session (restart, expiry) answers NOT_FOUND and is re-sent the
whole committed sequence, so no request fails because of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from coordinator.adaptive import DEFAULT_ALPHA_PRIOR, PRIOR_WEIGHT, AdaptiveK
from coordinator.branches import Branching, Speculation
from coordinator.breaker import CircuitBreaker
from coordinator.clients import CallRejected, DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.requests import Chunk, GenerationRequest, Job, PairInfo, prepare_job
from coordinator.sampling import RoundOutcome, decide_round
from coordinator.seeds import RequestStreams, next_seed
from coordinator.state import DraftRefusals, Round, SessionView, check_reply, round_from
from coordinator.text import FINISH_LENGTH, TextAssembler
from coordinator.upstream import UpstreamCalls
from specdec import wire
from specdec.errors import ResourceExhausted, Unavailable
from specdec.telemetry import tracer
from specdec.tree_sampling import TreeOutcome, decide_tree, tree_size
from specdec.v1 import common_pb2, draft_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Coordinator(Branching, UpstreamCalls):
    """Runs requests: validation (coordinator.requests), the round loop here, pre-drafts and
    hedges (coordinator.branches), and the calls to the services (coordinator.upstream)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        draft: DraftClient,
        target: TargetClient,
        tokenizer: PreTrainedTokenizerBase,
        pair: PairInfo,
        target_info: common_pb2.ModelInfo,
    ) -> None:
        self.config = config
        self.draft = draft
        self.target = target
        self.tokenizer = tokenizer
        self.pair = pair
        self._cleanup: set[asyncio.Task] = set()
        # The K chooser's acceptance prior, learned from finished requests (seeded sampled
        # requests start from the fixed default, so their K depends only on themselves).
        self._alpha_prior = DEFAULT_ALPHA_PRIOR
        # Shared by all requests: a dead draft costs one request its retries, not every round of every request.
        self.breaker = CircuitBreaker(config.breaker_failures)
        self._probe: asyncio.Task | None = None
        self._target_info = target_info  # to rebuild the pair when the draft changes (UpstreamCalls)
        self._refresh: asyncio.Task | None = None
        # Validation, chat templating and tokenising run here, one request at a time (as vLLM's
        # tokenizer thread), never on the event loop: a large request costs its own latency, not
        # a stall of every stream in flight.
        self._requests_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="requests")

    def prepare(self, request: GenerationRequest) -> Job:
        """Validates a request (coordinator.requests)."""
        return prepare_job(request, self.config, self.pair, self.tokenizer)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the requests thread: request handling that grows with the request's size."""
        return await asyncio.get_running_loop().run_in_executor(self._requests_thread, fn, *args)

    def close(self) -> None:
        for task in (self._probe, self._refresh):
            if task is not None:
                task.cancel()
        self._requests_thread.shutdown(wait=False, cancel_futures=True)

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
        samples exist, the rule that selects them looks only at the finished round and e1,
        and the next round verifies them against the distributions they came from. Any
        other outcome cancels the pre-draft (gRPC cancellation) and its tokens are never read.

        With catch-up steps (`--catch-up`, on by default), a pipelined round that has no drafts
        ready (the first round, or one after a missed pre-draft) does not wait for the draft:
        it is one target-only step (K = 0: the target samples the next token), while a
        pre-draft catches the draft session up and guesses that token before drafting on. The
        same rule keeps the pre-draft only when its guess equals the step's token. Whether a
        round is a catch-up step depends on the earlier outcomes alone, never on timing, so
        a seed still maps to one output.

        Hedged mode (`--hedges N`) also forks the draft session during each verify for the N
        likeliest rejection outcomes "draft j rejected, token t recovered" (coordinator.hedging)
        and drafts the round that would follow each. A branch is used only when the round ended
        exactly as it assumed; then it holds the committed prefix and drafts drawn given exactly
        that prefix, so the same argument applies. The others are cancelled and their sessions freed.
        """
        job = await self.off_loop(self.prepare, request)
        stats = GenerationStats(prompt_tokens=len(job.prompt_ids), target_numerics=self.pair.target_numerics)
        # Give up on an unavailable target in time to tell the client so before its own deadline.
        retry_for = (
            self.config.target_retry_s
            if time_remaining_s is None
            else min(self.config.target_retry_s, 0.7 * time_remaining_s)
        )
        retry_until = asyncio.get_running_loop().time() + retry_for
        streams = RequestStreams.of(job.seed)
        session_id = uuid.uuid4().hex
        draft_view, target_view = (
            SessionView(session_id, min_confidence=job.draft_min_confidence, vocab_limit=self.pair.draft_vocab_limit),
            SessionView(session_id),
        )
        sampling = wire.params_to_pb(job.params)
        sequence = list(job.prompt_ids)
        text = TextAssembler(self.tokenizer, job.prompt_ids, set(self.pair.eos_token_ids), job.stop, job.max_new_tokens)
        pipelined = self.config.pipeline and job.num_speculative_tokens != 0
        hedging = self.config.hedges > 0 and job.num_speculative_tokens != 0
        adaptive = self._adaptive(job, pipelined)
        copying = self._copying(adaptive)
        stats.pipelined = pipelined
        ready: Round | None = None  # drafts for the next round, from a kept pre-draft or hedge
        ready_source = ""
        speculation: Speculation | None = None  # branches in flight during a verify
        refusals = DraftRefusals()  # the draft could not hold this request: target-only rounds, then ask again
        catch_up_failed = False  # the last catch-up's draft call failed: draft the next round afresh
        try:
            while True:
                with tracer.start_as_current_span(
                    "round", attributes={"specdec.round.index": stats.rounds}
                ) as round_span:
                    round_started = stats.elapsed_ms()
                    compute_before = stats.draft_compute_ms + stats.target_compute_ms
                    remaining = job.max_new_tokens - len(text.token_ids)
                    limit = self._k_limit(len(sequence), remaining)
                    if adaptive is not None:
                        k, shape = adaptive.choose_shape()  # shape: a tree's widths, or () for a chain of K
                    else:
                        k, shape = job.num_speculative_tokens, job.tree_widths
                    k = min(k, limit)
                    # The most tokens a copy may carry (a tree round copies none).
                    copy_limit = 0 if shape else self._copy_limit(job, copying, k, limit)
                    widths = shape[:limit]  # a tree's shape, as deep as there is room for
                    if widths and not self.pair.trees:
                        widths = ()  # the draft stopped serving trees (restarted as another drafter)
                    if (k or copy_limit or widths) and not (refusals.allow(stats.rounds) and self.breaker.allow()):
                        k = copy_limit = 0  # the draft is down: this round is one target-only step
                        widths = ()
                        stats.fallback_rounds += 1
                    draft_seed, target_seed = next_seed(streams.draft), next_seed(streams.target)
                    predraft_seed = next_seed(streams.predraft)
                    # One per position a proposal may fill, drawn whatever it turns out to be.
                    # A tree's: one per node, tried or not.
                    uniforms = streams.coins.random(tree_size(widths) or max(k, copy_limit)).tolist()
                    draft_in_round = bool(k or copy_limit or widths)  # the draft session will hold this round's drafts
                    source = "none"  # where this round's drafts come from
                    # Pipelined, nothing ready: rather than leave the target idle while the draft
                    # drafts, run this round as one target-only step and draft the round after it
                    # meanwhile (its pre-draft). Decided by the previous outcomes alone, as K is.
                    catch_up = (
                        pipelined
                        and self.config.catch_up
                        and bool(k)
                        and not (copy_limit or widths)  # a copy costs no pass; a tree is not pipelined
                        and (ready is None or not ready.draft_token_ids)
                        and not catch_up_failed
                        and self.breaker.allow()
                    )
                    if ready is not None and ready.draft_token_ids and k:
                        round_, source = ready.truncated(k), ready_source
                        stats.ready_rounds += 1
                    elif catch_up:
                        round_, source, draft_in_round = Round(), "catch-up", False
                        stats.catch_up_rounds += 1
                    elif k or copy_limit or widths:
                        source = "draft"
                        try:
                            proposal = await self._propose_with_retries(
                                draft_view,
                                sequence,
                                k,
                                sampling,
                                draft_seed,
                                stats,
                                max_copied=copy_limit if self.pair.draft_copies and not widths else None,
                                tree_widths=widths,
                            )
                        except (Unavailable, CallRejected, ResourceExhausted) as exc:
                            # Target-only for this round: the same output, only slower. Not only
                            # UNAVAILABLE: a draft restarted with other capabilities rejects calls
                            # it used to take, one short of sessions or memory refuses this
                            # request (target-only rounds, then it asks again: DraftRefusals),
                            # and the draft only ever speeds a request up. A broken draft (NaN
                            # logits: INTERNAL) still fails the request, loudly
                            # (tests/integration/test_guards.py).
                            self._draft_failed(exc, draft_view, stats)
                            if isinstance(exc, ResourceExhausted):
                                refusals.refused(stats.rounds)
                            round_, source, draft_in_round = Round(), "fallback", False
                        else:
                            self.breaker.record_success()
                            refusals.accepted()
                            round_ = self._round_from(
                                proposal, tree_size(widths) or (copy_limit if proposal.copied else k)
                            )
                            if round_.copied:
                                source = "copy"
                            stats.draft_compute_ms += proposal.compute_ms
                    else:
                        round_ = Round()
                    ready = None
                    # A drafter may propose fewer than K (a prompt lookup with no match proposes none).
                    proposed = len(round_.draft_token_ids)
                    base = len(sequence)
                    verify = asyncio.ensure_future(
                        self._verify(target_view, sequence, round_, sampling, target_seed, stats, retry_until)
                    )
                    # Pre-draft only if a fully accepted round would leave room for another round: the
                    # bonus guess plus up to K drafts for it.
                    next_limit = self._k_limit(base + proposed + 1, remaining - proposed - 1)
                    # A catch-up step has no drafts of its own: its pre-draft carries the new
                    # tokens the draft session lacks, guesses this step's token and drafts up
                    # to K after it (no hedges: there are no runner-ups to hedge on).
                    if (pipelined or hedging) and k and (proposed or catch_up) and self.breaker.allow():
                        speculation = self._start_speculation(
                            draft_view,
                            sequence,
                            round_,
                            min(k, next_limit) + 1 if pipelined and next_limit else 0,
                            k if hedging else 0,
                            remaining,
                            sampling,
                            predraft_seed,
                            streams.hedge,
                            stats,
                            catch_up=catch_up,
                        )
                    try:
                        verification = await verify
                    finally:
                        if not verify.done():
                            verify.cancel()
                    check_reply(
                        self.target.address,
                        "draft_token_target_probs",
                        len(verification.draft_token_target_probs),
                        proposed,
                    )
                    check_reply(
                        self.target.address,
                        "recovered_token_ids",
                        len(verification.recovered_token_ids),
                        proposed + 1 if round_.parents else proposed,  # a tree's: one per node and the root
                    )
                    stats.target_compute_ms += verification.compute_ms
                    outcome: RoundOutcome | TreeOutcome
                    if round_.parents:  # multi-step speculative sampling (specdec.tree_sampling)
                        outcome = decide_tree(
                            verification.draft_token_target_probs,
                            round_.draft_token_draft_probs,
                            uniforms[:proposed],
                            round_.parents,
                            verification.recovered_token_ids,
                        )
                    else:
                        outcome = decide_round(
                            verification.draft_token_target_probs,
                            round_.draft_token_draft_probs,
                            uniforms[:proposed],
                            verification.recovered_token_ids,
                            verification.bonus_token_id,
                        )
                    stats.record_round(proposed, outcome.num_accepted, outcome.is_bonus(proposed))
                    stats.tree_rounds += bool(round_.parents)
                    if round_.copied:  # from a draft call, a pre-draft or a hedge alike
                        stats.copied_rounds += 1
                        stats.copied_tokens += proposed
                        stats.copied_accepted += outcome.num_accepted
                    if copying is not None and round_.copied:
                        copying.observe_round(proposed, outcome.num_accepted)  # copies' acceptance apart
                    elif adaptive and isinstance(outcome, TreeOutcome):
                        adaptive.observe_tree(widths, outcome.path)
                    elif adaptive:
                        adaptive.observe_round(proposed, outcome.num_accepted)
                    # Both services hold sequence + drafts; only the accepted drafts stay valid. After
                    # a tree both hold the committed sequence, the nodes cached behind it: the next
                    # call's new tokens (the accepted path first) tell them which nodes to keep.
                    held = base + (0 if round_.parents else outcome.num_accepted)
                    target_view.synced = held
                    if draft_in_round:
                        draft_view.synced = held
                    finished = False
                    for token in outcome.committed(round_.draft_token_ids):
                        sequence.append(token)
                        if finished := text.push(token):
                            break
                    if not finished and len(sequence) >= self.pair.max_context:
                        text.finish(FINISH_LENGTH)
                    if speculation is not None:
                        live = text.finish_reason is None
                        taken, ready_source, draft_view = await self._settle(
                            speculation, outcome, proposed, live, draft_view, base, stats
                        )
                        # A catch-up whose call failed (a restarted draft: NOT_FOUND) must not be
                        # retried as one: the regular draft call re-prefills and counts failures.
                        catch_up_failed = speculation.failed
                        if speculation.refused:  # a pre-draft refused is a refusal like any draft call's
                            refusals.refused(stats.rounds)
                        speculation = None
                        if taken is not None:
                            ready = taken
                            refusals.accepted()  # the draft took the branch's call
                    stats.mark_first_token()
                    delta = text.take_delta()
                    stats.round_ms.append(stats.elapsed_ms() - round_started)
                    stats.round_overhead_ms.append(
                        stats.round_ms[-1] - (stats.draft_compute_ms + stats.target_compute_ms - compute_before)
                    )
                    round_span.set_attributes(
                        {
                            "specdec.round.k": proposed,
                            "specdec.round.accepted": outcome.num_accepted,
                            "specdec.round.next_token": "bonus" if outcome.is_bonus(proposed) else "recovered",
                            # draft, copy (prompt lookup), predraft, hedge, catch-up (a target-only step while the
                            # draft catches up), fallback (draft down), none (K=0)
                            "specdec.round.drafts_from": source,
                            "specdec.round.epoch": draft_view.last_epoch,
                            "specdec.round.pipelined": pipelined,
                        }
                    )
                # Spans end before yielding: the caller runs between rounds.
                if text.finish_reason is not None:
                    stats.close(len(text.token_ids))
                    self._learn(adaptive)
                    yield Chunk(delta.token_ids, delta.text, text.finish_reason, stats)
                    return
                yield Chunk(delta.token_ids, delta.text)
        finally:
            if speculation is not None:
                self._drop(speculation)
            self._end_sessions(draft_view, target_view)

    def _k_limit(self, length: int, remaining: int) -> int:
        """The most drafts a round may carry, from a sequence of `length` with `remaining` new
        tokens allowed: room for the drafts plus the recovered/bonus token, in both models."""
        room = self.pair.max_context - length
        return max(
            0, min(self.pair.max_num_speculative_tokens, remaining - 1, room - 1, self.pair.draft_max_context - length)
        )

    def _adaptive(self, job: Job, pipelined: bool) -> AdaptiveK | None:
        """A per-request K chooser when the request left K to the coordinator and it adapts."""
        if not (self.config.adaptive_k and job.num_speculative_tokens_unset and job.num_speculative_tokens):
            return None
        if self.pair.costs is None:
            return None  # no measured costs to choose from: the default K
        return AdaptiveK(
            k_max=self.pair.max_num_speculative_tokens,
            pipelined=pipelined,
            costs=self.pair.costs,
            # A seeded sampled request's output depends on K, so its K may depend on nothing but
            # itself; greedy output is the target's whatever K is.
            alpha_prior=DEFAULT_ALPHA_PRIOR if job.seeded and not job.params.greedy else self._alpha_prior,
            trees=self.config.tree_chooser and self.pair.trees and not self.config.hedges,
        )

    def _copying(self, adaptive: AdaptiveK | None) -> AdaptiveK | None:
        """How many tokens a copy may carry, when the draft copies by prompt lookup and K is
        left to the chooser: a second chooser over the same target costs with drafts that cost
        nothing (a copy runs no pass), learning from copied rounds only. Long copies pay where
        they are right (an edit that repeats code), short ones where they are not, since each
        copied token lengthens the verify."""
        if adaptive is None or not self.pair.draft_copies or self.pair.costs is None:
            return None
        free_drafts = dataclasses.replace(self.pair.costs, draft_pass_ms=(0.0,) * len(self.pair.costs.draft_pass_ms))
        return AdaptiveK(
            k_max=self.pair.max_num_speculative_tokens,
            pipelined=False,
            costs=free_drafts,
            alpha_prior=DEFAULT_ALPHA_PRIOR,
        )

    def _copy_limit(self, job: Job, copying: AdaptiveK | None, k: int, limit: int) -> int:
        """ProposeRequest.max_copied_tokens for this round, an exact cap (0: no copy; with
        K = 0 too, no draft call). A request that fixes K copies at most K; target-only
        requests (K = 0) never copy."""
        if not self.pair.draft_copies or job.num_speculative_tokens == 0:
            return 0
        if copying is None:
            return k
        return min(copying.choose(), limit)

    def _learn(self, adaptive: AdaptiveK | None) -> None:
        """Carries the finished request's acceptance into the next request's prior."""
        if adaptive is not None and adaptive.reached > PRIOR_WEIGHT:
            self._alpha_prior = 0.8 * self._alpha_prior + 0.2 * adaptive.alpha

    def _round_from(self, proposal: draft_pb2.ProposeResponse, k: int) -> Round:
        return round_from(proposal, k, self.draft.address, self.pair.vocab_size)
