"""The generation loop: draft proposes, target verifies, the coordinator accepts or rejects.

Each round sends each service only what it has not seen: the service keeps the session's
sequence and KV cache, and the coordinator tracks how much of it is still valid (`synced`).
A service that lost the session (restart, expiry) answers NOT_FOUND and is re-sent the
whole committed sequence, so no request fails because of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential
from transformers import PreTrainedTokenizerBase

from coordinator.adaptive import DEFAULT_ALPHA_PRIOR, PRIOR_WEIGHT, AdaptiveK, RoundCosts
from coordinator.breaker import CircuitBreaker
from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.hedging import Hedge, acceptance_estimate, plan_hedges
from coordinator.metrics import GenerationStats
from coordinator.sampling import decide_round
from coordinator.seeds import RequestStreams, next_seed
from coordinator.text import FINISH_LENGTH, TextAssembler
from specdec import wire
from specdec.errors import DeadlineExceeded, InvalidArgument, SessionNotFound, SpecDecError, Unavailable
from specdec.probs import SamplingParams
from specdec.telemetry import tracer
from specdec.v1 import draft_pb2, target_pb2

logger = logging.getLogger(__name__)

# Below this, logits / temperature overflows float32 to inf and the distributions become NaN;
# such a temperature is greedy in all but ties anyway (vLLM treats < 1e-5 as greedy). Rounded
# to float32 as the request carries it, so a client that sends 1e-5 is accepted.
MIN_TEMPERATURE = float(np.float32(1e-5))


@dataclass(frozen=True)
class GenerationRequest:
    """A client request as the domain sees it (fields as in GenerateRequest; None = unset)."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None
    draft_min_confidence: float | None = None


@dataclass(frozen=True)
class PairInfo:
    """What start-up learned from both services' Info."""

    vocab_size: int  # ids valid for both models
    eos_token_ids: frozenset[int]
    max_context: int  # the target's
    draft_max_context: int
    max_num_speculative_tokens: int  # the config's maximum, capped by both services'
    costs: RoundCosts | None = None  # measured pass and RPC costs; None when a service did not calibrate


@dataclass(frozen=True)
class Job:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...]
    num_speculative_tokens: int
    num_speculative_tokens_unset: bool = False  # the request left K to the coordinator
    seeded: bool = False  # the request set its seed: K may not depend on other requests
    draft_min_confidence: float | None = None  # None: the draft service's default


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class _SessionView:
    """The coordinator's record of one service's session."""

    session_id: str
    synced: int = 0  # leading tokens of the committed sequence the service holds
    opened: bool = False
    calls: Iterator[int] = field(default_factory=lambda: itertools.count(1))  # numbers Propose calls (epochs)
    last_epoch: int = 0  # of the newest regular call sent
    min_confidence: float | None = None  # the request's draft confidence stop (None: the service's)

    def confidence_field(self) -> dict:
        """ProposeRequest keywords: the field is optional, and unset means the service's default."""
        return {} if self.min_confidence is None else {"min_confidence": self.min_confidence}


@dataclass
class _Round:
    draft_token_ids: list[int] = field(default_factory=list)
    draft_token_draft_probs: list[float] = field(default_factory=list)
    distributions: list = field(default_factory=list)
    runner_up_ids: list[int] = field(default_factory=list)  # per draft, for hedging; may be empty
    runner_up_probs: list[float] = field(default_factory=list)

    def truncated(self, k: int, start: int = 0) -> _Round:
        end = start + k
        return _Round(
            self.draft_token_ids[start:end],
            self.draft_token_draft_probs[start:end],
            self.distributions[start:end],
            self.runner_up_ids[start:end],
            self.runner_up_probs[start:end],
        )


@dataclass(frozen=True)
class _BranchPlan:
    """One branch of a speculation: the pre-draft (`hedge` None: the request's own draft
    session continues as if every draft is accepted) or a hedge (a fork assuming `hedge`)."""

    k: int
    session_id: str
    hedge: Hedge | None = None


@dataclass
class _Speculation:
    """The branches drafted during one verify, in one ProposeBranches call, so the draft
    steps them all in the same forward passes. Tagged with the round that started it: it is
    settled before the next round begins, and offering it to any other round is a bug."""

    round_index: int
    branches: list[_BranchPlan]
    task: asyncio.Future  # the ProposeBranches call

    @property
    def predraft(self) -> _BranchPlan | None:
        return next((b for b in self.branches if b.hedge is None), None)

    @property
    def forks(self) -> list[_BranchPlan]:
        return [b for b in self.branches if b.hedge is not None]

    def cancel(self) -> None:
        """Cancels the RPC (the draft stops every branch at its next step); a reply that
        already arrived is dropped unread."""
        self.task.cancel()
        # Retrieve any exception so asyncio does not log it as never retrieved.
        self.task.add_done_callback(lambda task: task.cancelled() or task.exception())


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        draft: DraftClient,
        target: TargetClient,
        tokenizer: PreTrainedTokenizerBase,
        pair: PairInfo,
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

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    def prepare(self, request: GenerationRequest) -> Job:
        """Validates a request; every failure says what was wrong and what is accepted."""
        config, pair = self.config, self.pair
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("set exactly one of prompt and prompt_token_ids; both were set")
        if request.prompt:
            prompt_ids = list(self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
            if not prompt_ids:
                raise InvalidArgument("prompt encodes to no tokens; send non-empty text")
        elif request.prompt_token_ids:
            prompt_ids = list(request.prompt_token_ids)
            for i, token in enumerate(prompt_ids):
                if not 0 <= token < pair.vocab_size:
                    raise InvalidArgument(
                        f"prompt_token_ids[{i}] = {token} is outside the vocabulary; ids must be in [0, "
                        f"{pair.vocab_size})"
                    )
        else:
            raise InvalidArgument("prompt is empty: set prompt (text) or prompt_token_ids")
        if len(prompt_ids) >= pair.max_context:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {pair.max_context}, "
                f"so at most {pair.max_context - 1} prompt tokens are accepted"
            )
        max_new_tokens = config.default_max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}]; got {max_new_tokens}")
        if not (
            math.isfinite(request.temperature) and (request.temperature == 0 or request.temperature >= MIN_TEMPERATURE)
        ):
            raise InvalidArgument(
                f"temperature must be a finite number >= 0 (0 = greedy), and if positive at least {MIN_TEMPERATURE:g} "
                f"(smaller ones overflow the logits); got {request.temperature}"
            )
        if request.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off); got {request.top_k}")
        top_p = 1.0 if request.top_p is None else request.top_p
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1] (1.0 = off); got {top_p}")
        if request.num_speculative_tokens is None:
            # The configured default, within what both services accept.
            k = min(config.default_num_speculative_tokens, pair.max_num_speculative_tokens)
        else:
            k = request.num_speculative_tokens
        if not 0 <= k <= pair.max_num_speculative_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {pair.max_num_speculative_tokens}] (0 = target only); got {k}"
            )
        if len(request.stop) > config.max_stop_strings:
            raise InvalidArgument(
                f"stop has {len(request.stop)} strings; at most {config.max_stop_strings} are accepted"
            )
        for stop in request.stop:
            if not 0 < len(stop) <= config.max_stop_string_chars:
                raise InvalidArgument(
                    f"stop strings must have 1 to {config.max_stop_string_chars} characters; got one of {len(stop)}"
                )
        confidence = request.draft_min_confidence
        if confidence is not None and not (math.isfinite(confidence) and 0.0 <= confidence <= 1.0):
            raise InvalidArgument(f"draft_min_confidence must be in [0, 1] (0 = never stop early); got {confidence}")
        seed = secrets.randbits(63) if request.seed is None else request.seed
        return Job(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            params=SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=top_p),
            seed=seed,
            stop=tuple(request.stop),
            num_speculative_tokens=k,
            num_speculative_tokens_unset=request.num_speculative_tokens is None,
            seeded=request.seed is not None,
            draft_min_confidence=confidence,
        )

    async def generate(self, request: GenerationRequest, time_remaining_s: float | None = None) -> AsyncIterator[Chunk]:
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

        Hedged mode (`--hedges N`) also forks the draft session during each verify for the N
        likeliest rejection outcomes "draft j rejected, token t recovered" (coordinator.hedging)
        and drafts the round that would follow each. A branch is used only when the round ended
        exactly as it assumed; then it holds the committed prefix and drafts drawn given exactly
        that prefix, so the same argument applies. The others are cancelled and their sessions freed.
        """
        job = self.prepare(request)
        stats = GenerationStats(prompt_tokens=len(job.prompt_ids))
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
            _SessionView(session_id, min_confidence=job.draft_min_confidence),
            _SessionView(session_id),
        )
        sampling = wire.params_to_pb(job.params)
        sequence = list(job.prompt_ids)
        text = TextAssembler(self.tokenizer, job.prompt_ids, set(self.pair.eos_token_ids), job.stop, job.max_new_tokens)
        pipelined = self.config.pipeline and job.num_speculative_tokens != 0
        hedging = self.config.hedges > 0 and job.num_speculative_tokens != 0
        adaptive = self._adaptive(job, pipelined)
        stats.pipelined = pipelined
        ready: _Round | None = None  # drafts for the next round, from a kept pre-draft or hedge
        ready_source = ""
        speculation: _Speculation | None = None  # branches in flight during a verify
        try:
            while True:
                with tracer.start_as_current_span(
                    "round", attributes={"specdec.round.index": stats.rounds}
                ) as round_span:
                    round_started = stats.elapsed_ms()
                    compute_before = stats.draft_compute_ms + stats.target_compute_ms
                    remaining = job.max_new_tokens - len(text.token_ids)
                    limit = self._k_limit(len(sequence), remaining)
                    k = min(adaptive.choose() if adaptive else job.num_speculative_tokens, limit)
                    if k and not self.breaker.allow():
                        k = 0  # the draft is down: this round is one target-only step
                        stats.fallback_rounds += 1
                    draft_seed, target_seed = next_seed(streams.draft), next_seed(streams.target)
                    predraft_seed = next_seed(streams.predraft)
                    uniforms = streams.coins.random(k).tolist()  # [K]
                    draft_in_round = bool(k)  # the draft session will hold this round's drafts
                    source = "none"  # where this round's drafts come from
                    if ready is not None and ready.draft_token_ids and k:
                        round_, source = ready.truncated(k), ready_source
                        stats.ready_rounds += 1
                    elif k:
                        source = "draft"
                        try:
                            proposal = await self._propose_with_retries(
                                draft_view, sequence, k, sampling, draft_seed, stats
                            )
                        except Unavailable as exc:
                            # Target-only for this round: the same output, only slower.
                            self._draft_failed(exc, draft_view, stats)
                            round_, source, draft_in_round = _Round(), "fallback", False
                        else:
                            self.breaker.record_success()
                            round_ = self._round_from(proposal, k)
                            stats.draft_compute_ms += proposal.compute_ms
                    else:
                        round_ = _Round()
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
                    if (pipelined or hedging) and proposed and self.breaker.allow():
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
                        )
                    try:
                        verification = await verify
                    finally:
                        if not verify.done():
                            verify.cancel()
                    _check_reply(
                        self.target.address,
                        "draft_token_target_probs",
                        len(verification.draft_token_target_probs),
                        proposed,
                    )
                    _check_reply(
                        self.target.address, "recovered_token_ids", len(verification.recovered_token_ids), proposed
                    )
                    stats.target_compute_ms += verification.compute_ms
                    outcome = decide_round(
                        verification.draft_token_target_probs,
                        round_.draft_token_draft_probs,
                        uniforms[:proposed],
                        verification.recovered_token_ids,
                        verification.bonus_token_id,
                    )
                    stats.record_round(proposed, outcome.num_accepted)
                    if adaptive:
                        adaptive.observe_round(proposed, outcome.num_accepted)
                    # Both services hold sequence + drafts; only the accepted drafts stay valid.
                    target_view.synced = base + outcome.num_accepted
                    if draft_in_round:
                        draft_view.synced = base + outcome.num_accepted
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
                        speculation = None
                        if taken is not None:
                            ready = taken
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
                            # draft, predraft, hedge, fallback (draft down), none (K=0)
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
        )

    def _learn(self, adaptive: AdaptiveK | None) -> None:
        """Carries the finished request's acceptance into the next request's prior."""
        if adaptive is not None and adaptive.reached > PRIOR_WEIGHT:
            self._alpha_prior = 0.8 * self._alpha_prior + 0.2 * adaptive.alpha

    def _round_from(self, proposal: draft_pb2.ProposeResponse, k: int) -> _Round:
        if len(proposal.token_ids) > k:
            raise SpecDecError(
                f"service at {self.draft.address} proposed {len(proposal.token_ids)} tokens for K={k}; the reply is "
                "malformed"
            )
        _check_reply(self.draft.address, "distributions", len(proposal.distributions), len(proposal.token_ids))
        if proposal.runner_up_token_ids or proposal.runner_up_probs:  # optional, but whole if sent
            _check_reply(
                self.draft.address, "runner_up_token_ids", len(proposal.runner_up_token_ids), len(proposal.token_ids)
            )
            _check_reply(self.draft.address, "runner_up_probs", len(proposal.runner_up_probs), len(proposal.token_ids))
        draft_probs = [wire.token_probability(d, t) for d, t in zip(proposal.distributions, proposal.token_ids)]
        for position, (token, prob) in enumerate(zip(proposal.token_ids, draft_probs)):
            # u * 0 < target_prob would accept the token with probability 1, and NaN would never
            # accept it: either way the output would stop being the target's distribution.
            if not 0.0 < prob <= 1.0 + 1e-5:
                raise SpecDecError(
                    f"draft service at {self.draft.address} proposed token {token} at position {position} with "
                    f"probability {prob} under the distribution it sent with it; a drafter can only propose tokens "
                    "its distribution gives mass, so the reply is malformed"
                )
        return _Round(
            list(proposal.token_ids),
            draft_probs,
            list(proposal.distributions),
            list(proposal.runner_up_token_ids),
            list(proposal.runner_up_probs),
        )

    def _start_speculation(
        self,
        draft_view: _SessionView,
        sequence: list[int],
        round_: _Round,
        predraft_k: int,
        hedge_k: int,
        remaining: int,
        sampling,
        predraft_seed: int,
        hedge_seeds: np.random.Generator,
        stats: GenerationStats,
    ) -> _Speculation | None:
        """Starts, while the target verifies, one ProposeBranches call drafting the next round
        for the likeliest outcomes of this one, all branches stepped in the same passes:

        - the pre-draft (`predraft_k` > 0): the draft session, which holds `sequence` plus this
          round's drafts, continues for the bonus guess plus up to predraft_k - 1 drafts;
        - hedges (`hedge_k` > 0): forks of the session for the likeliest rejection outcomes
          "draft j rejected, token t recovered" (coordinator.hedging), each drafting the round
          that would follow. They are listed first, so they copy the session before the
          pre-draft extends it and share its passes.
        """
        plans: list[_BranchPlan] = []
        requests: list[draft_pb2.ProposeRequest] = []
        base = len(sequence)
        if hedge_k and round_.runner_up_ids:  # prompt lookup has no distributions to hedge on
            alpha = acceptance_estimate(stats.accepted_tokens, stats.proposed_tokens)
            for hedge in plan_hedges(
                round_.runner_up_ids, round_.runner_up_probs, alpha, self.config.hedges, self.pair.eos_token_ids
            ):
                limit = self._k_limit(base + hedge.position + 1, remaining - hedge.position - 1)
                if not limit:
                    continue
                plans.append(_BranchPlan(min(hedge_k, limit), uuid.uuid4().hex, hedge))
                requests.append(
                    draft_pb2.ProposeRequest(
                        session_id=plans[-1].session_id,
                        fork_from=draft_view.session_id,
                        keep_tokens=base + hedge.position,
                        new_tokens=[hedge.recovered_token_id],
                        num_tokens=plans[-1].k,
                        sampling=sampling,
                        seed=next_seed(hedge_seeds),
                        **draft_view.confidence_field(),
                    )
                )
        if predraft_k:
            plans.append(_BranchPlan(min(predraft_k, self.pair.max_num_speculative_tokens), draft_view.session_id))
            # The session holds the sequence and this round's drafts: nothing to send.
            requests.append(
                draft_pb2.ProposeRequest(
                    session_id=draft_view.session_id,
                    keep_tokens=base + len(round_.draft_token_ids),
                    new_tokens=[],
                    num_tokens=plans[-1].k,
                    sampling=sampling,
                    seed=predraft_seed,
                    **draft_view.confidence_field(),
                )
            )
        if not plans:
            return None
        # Numbered after every call the session has served, so none is refused as stale; the
        # session's next regular call is numbered after these.
        for request in requests:
            request.epoch = next(draft_view.calls)
        stats.predrafts += predraft_k > 0
        stats.hedges += len(plans) - (predraft_k > 0)
        task = asyncio.ensure_future(self.draft.propose_branches(draft_pb2.ProposeBranchesRequest(branches=requests)))
        return _Speculation(round_index=stats.rounds, branches=plans, task=task)

    async def _settle(
        self,
        speculation: _Speculation,
        outcome,
        proposed: int,
        live: bool,
        draft_view: _SessionView,
        base: int,
        stats: GenerationStats,
    ) -> tuple[_Round | None, str, _SessionView]:
        """The next round's drafts, if a branch assumed the outcome that happened: (drafts,
        "predraft" or "hedge", the draft session to use from now on).

        Which branch is used depends on the verification outcome alone (and, for the
        pre-draft, on its own first draw equalling the bonus token): a hedge when draft j was
        rejected and t recovered exactly as it assumed, the pre-draft when every draft was
        accepted. A branch so chosen holds the committed prefix and drafts drawn from the draft
        given exactly that prefix, before the next round's coins exist; the next round
        verifies them against the distributions they came from, so the output distribution is
        the target's (the argument in `Coordinator.generate`). Unused forks are freed; when a
        hedge is used, its fork becomes the request's draft session and the old one is freed.
        """
        if speculation.round_index != stats.rounds - 1:
            raise AssertionError(f"branches of round {speculation.round_index} offered to round {stats.rounds - 1}")
        hit: _BranchPlan | None = None
        if live and outcome.num_accepted == proposed:
            hit = speculation.predraft
        elif live:
            hit = next(
                (
                    b
                    for b in speculation.forks
                    if b.hedge is not None
                    and (b.hedge.position, b.hedge.recovered_token_id) == (outcome.num_accepted, outcome.next_token_id)
                ),
                None,
            )
        if hit is None:
            self._drop(speculation)
            stats.predraft_cancelled += speculation.predraft is not None
            return None, "", draft_view
        waited_from = stats.elapsed_ms()
        try:
            reply = await speculation.task
        except SpecDecError as exc:
            # A failed call only means the next round drafts afresh (or falls back).
            logger.info("pre-draft/hedge call failed, drafting afresh: %s", exc)
            self._drop(speculation)
            stats.predraft_cancelled += speculation.predraft is not None
            return None, "", draft_view
        finally:
            stats.branch_wait_ms += stats.elapsed_ms() - waited_from
        _check_reply(self.draft.address, "branch results", len(reply.results), len(speculation.branches))
        taken: _Round | None = None
        for plan, result in zip(speculation.branches, reply.results):
            failed = result.error_code != 0
            if failed:
                logger.info(
                    "branch %s failed (status %d): %s", plan.session_id, result.error_code, result.error_message
                )
                branch = _Round()
            else:
                branch = self._round_from(result.proposal, plan.k)
            if plan.hedge is None:
                stats.predraft_compute_ms += result.proposal.compute_ms
                stats.predrafted_tokens += len(branch.draft_token_ids)
                # A pre-draft that stopped at its first token (a confidence stop) has nothing to
                # offer past the guess: it counts as a miss, as does a failed one.
                if (
                    plan is hit
                    and len(branch.draft_token_ids) > 1
                    and branch.draft_token_ids[0] == outcome.next_token_id
                ):
                    trace.get_current_span().add_event(
                        "predraft.used", {"specdec.tokens": len(branch.draft_token_ids) - 1}
                    )
                    stats.predraft_hits += 1
                    # The draft holds the round, the bonus token (= its first pre-draft token)
                    # and the rest of the pre-draft, which become the next drafts.
                    draft_view.synced = base + proposed + 1
                    taken = branch.truncated(len(branch.draft_token_ids), start=1)
                else:  # a miss, or a draft was rejected and a hedge was used
                    stats.predraft_misses += plan is hit
                    stats.predraft_cancelled += plan is not hit
                    stats.predraft_wasted_tokens += len(branch.draft_token_ids)
            elif plan is hit and not failed:
                trace.get_current_span().add_event(
                    "hedge.used",
                    {"specdec.position": plan.hedge.position, "specdec.tokens": len(branch.draft_token_ids)},
                )
                stats.hedge_hits += 1
                stats.hedged_tokens += len(branch.draft_token_ids)
                taken = branch
                self._end_later(self.draft, draft_view.session_id)
                draft_view = _SessionView(
                    plan.session_id,
                    synced=base + outcome.num_accepted + 1,
                    opened=True,
                    calls=draft_view.calls,
                    min_confidence=draft_view.min_confidence,
                )
            else:
                stats.hedge_wasted_tokens += len(branch.draft_token_ids)
                self._end_later(self.draft, plan.session_id)
        return taken, ("predraft" if hit.hedge is None else "hedge"), draft_view

    def _drop(self, speculation: _Speculation) -> None:
        """Cancels the branches' call and frees their forks (the pre-draft's session is the request's)."""
        speculation.cancel()
        for plan in speculation.forks:
            self._end_later(self.draft, plan.session_id)

    async def _propose_with_retries(
        self, view: _SessionView, sequence: list[int], k: int, sampling, seed: int, stats: GenerationStats
    ) -> draft_pb2.ProposeResponse:
        """A round's draft call, retried on UNAVAILABLE (a restarting draft, a dropped
        connection) but never on a missed deadline: a slow draft is skipped, not waited for."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.draft_attempts),
            wait=wait_exponential(multiplier=self.config.draft_retry_backoff_s, max=1.0),
            retry=retry_if_exception(
                lambda exc: isinstance(exc, Unavailable) and not isinstance(exc, DeadlineExceeded)
            ),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._propose(view, sequence, k, sampling, seed, stats)
        raise AssertionError("unreachable")

    def _draft_failed(self, exc: Unavailable, draft_view: _SessionView, stats: GenerationStats) -> None:
        """Counts a failed draft call, opens the breaker after enough of them, and forgets what
        the draft held: if it comes back, the next call re-sends the whole sequence."""
        stats.draft_failures += 1
        stats.fallback_rounds += 1
        draft_view.synced = 0
        trace.get_current_span().add_event("fallback", {"specdec.reason": str(exc)[:200]})
        logger.warning("draft call failed, round runs target-only: %s", exc)
        if self.breaker.record_failure():
            logger.warning(
                "draft at %s failed %d times in a row: rounds run target-only until a health probe finds it serving",
                self.draft.address,
                self.breaker.failure_threshold,
            )
            if self._probe is None or self._probe.done():
                self._probe = asyncio.get_running_loop().create_task(self._probe_draft())

    async def _probe_draft(self) -> None:
        """While the breaker is open, asks the draft's health service until it is SERVING."""
        while self.breaker.is_open:
            await asyncio.sleep(self.config.breaker_probe_interval_s)
            if await self.draft.serving():
                logger.info("draft at %s is serving again: speculation resumes", self.draft.address)
                self.breaker.close()

    async def _propose(
        self, view: _SessionView, sequence: list[int], k: int, sampling, seed: int, stats: GenerationStats
    ) -> draft_pb2.ProposeResponse:
        def send(keep: int, new_tokens: list[int]):
            view.last_epoch = next(view.calls)
            return self.draft.propose(
                draft_pb2.ProposeRequest(
                    session_id=view.session_id,
                    keep_tokens=keep,
                    new_tokens=new_tokens,
                    num_tokens=k,
                    sampling=sampling,
                    seed=seed,
                    epoch=view.last_epoch,
                    **view.confidence_field(),
                )
            )

        return await self._with_reprefill("draft", view, sequence, stats, send)

    async def _verify(
        self,
        view: _SessionView,
        sequence: list[int],
        round_: _Round,
        sampling,
        seed: int,
        stats: GenerationStats,
        retry_until: float,
    ) -> target_pb2.VerifyResponse:
        """The round's verify. A target that is UNAVAILABLE (restarting) is retried until
        `retry_until` (loop time); back up, it has lost the session, answers NOT_FOUND and is
        re-sent the committed sequence, so the output does not change."""

        def send(keep: int, new_tokens: list[int]):
            return self.target.verify(
                target_pb2.VerifyRequest(
                    session_id=view.session_id,
                    keep_tokens=keep,
                    new_tokens=new_tokens,
                    draft_token_ids=round_.draft_token_ids,
                    draft_distributions=round_.distributions,
                    sampling=sampling,
                    seed=seed,
                )
            )

        loop = asyncio.get_running_loop()
        retrying = AsyncRetrying(
            stop=lambda state: loop.time() >= retry_until,
            wait=wait_exponential(multiplier=0.1, max=1.0),
            retry=retry_if_exception(
                lambda exc: isinstance(exc, Unavailable) and not isinstance(exc, DeadlineExceeded)
            ),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    stats.target_retries += 1
                return await self._with_reprefill("target", view, sequence, stats, send)
        raise AssertionError("unreachable")

    async def _with_reprefill(self, role: str, view: _SessionView, sequence: list[int], stats: GenerationStats, send):
        """Sends only the unseen tail; if the service lost the session, re-sends everything once."""
        for attempt in range(2):
            view.opened = True  # even a failed call may have opened it; ending is idempotent
            started = stats.elapsed_ms()
            try:
                return await send(view.synced, sequence[view.synced :])
            except SessionNotFound:
                if attempt:
                    raise SpecDecError(
                        f"{role} service lost session {view.session_id} again right after a full re-send"
                    ) from None
                logger.info("%s lost session %s; re-sending %d tokens", role, view.session_id, len(sequence))
                trace.get_current_span().add_event(
                    "reprefill", {"specdec.service": role, "specdec.tokens": len(sequence)}
                )
                stats.reprefills += 1
                view.synced = 0
            finally:
                elapsed = stats.elapsed_ms() - started
                if role == "draft":
                    stats.draft_ms += elapsed
                else:
                    stats.target_ms += elapsed
        raise AssertionError("unreachable")

    def _end_sessions(self, draft_view: _SessionView, target_view: _SessionView) -> None:
        for client, view in ((self.draft, draft_view), (self.target, target_view)):
            if view.opened:
                self._end_later(client, view.session_id)

    async def wait_cleanup(self) -> None:
        """Until every session end already started has finished (before the services stop)."""
        while self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    def _end_later(self, client: DraftClient | TargetClient, session_id: str) -> None:
        """Frees a service's session without delaying (or being cancelled with) the request."""
        task = asyncio.get_running_loop().create_task(client.end_session(session_id))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)


def _check_reply(address: str, field_name: str, got: int, expected: int) -> None:
    """A node that answers with the wrong shape fails the request; it never corrupts output."""
    if got != expected:
        raise SpecDecError(f"service at {address} returned {got} {field_name} for K={expected}; the reply is malformed")
