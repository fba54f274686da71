"""One round of speculative decoding as its two pure phases: `plan_round` decides what the
round will do before anything is sent, and `commit_round` applies the verified outcome to
the request's state. Neither does I/O or reads a clock; the engine (coordinator.engine) runs
the calls between them.

A round's kind is chosen from the request's earlier outcomes and the costs the services
calibrated at start-up, never from a time measured during the request, so a seed maps to one
output on one running deployment:

    READY       drafts a kept pre-draft or hedge already holds
    CATCH_UP    a pipelined round with none ready, where a step pays (`catch_up_pays`): one
                target-only step while the draft catches its session up and drafts the round
                after it
    DRAFT_CALL  a Propose call: a chain of K, a copy (prompt lookup) or a tree
    FALLBACK    the draft is skipped (breaker open, or it refused this request lately)
    TARGET_ONLY K = 0: the target samples one token (a request that fixes K = 0: up to
                --target-only-steps, one seed each, in one Verify call)
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from coordinator.adaptive import AdaptiveK
from coordinator.hedging import Acceptance, PredraftDepth
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo
from coordinator.requests import Job
from coordinator.state import DraftRefusals, Round, SessionView, Source
from coordinator.text import FINISH_LENGTH, TextAssembler
from specdec.sampling.chain import RoundOutcome, decide_round
from specdec.sampling.seeds import RequestStreams, next_seed
from specdec.sampling.tree_sampling import TreeOutcome, decide_tree, tree_size
from specdec.v1 import common_pb2, target_pb2

# Where K is 0 and only a copy (prompt lookup) would make a draft call, a lookup that found
# nothing is not repeated for this many rounds (calls: one K = 0 round may carry several
# steps), on any deployment. Each such call is a round of one step where a target-only round
# following the load carries several, and its RPC waits on the draft: on 2 shared cores, 4
# concurrent requests with the hybrid drafter looked up every round and ran at 0.58-0.82x
# target-only (docs/design.md, "The K chooser", under load).
COPY_WAIT_ROUNDS = 2


@dataclass(frozen=True)
class RoundRules:
    """Rules of the rounds that only the benchmarks and tests turn off, to compare against or
    to reach one path alone; never flags, since the defaults were measured better where they
    act (docs/benchmarks.md): catch-up steps (+11% greedy, +7% sampled on the nodes suite;
    `catch_up_pays` decides per round whether one pays) and live pass costs for the K chooser
    (1.04-1.09x after a disturbed calibration). bench.rules_coordinator runs a coordinator
    process with other rules; tests pass them to `coordinator.server.connect`."""

    catch_up: bool = True  # off: a pipelined round with no drafts ready waits for fresh ones
    live_costs: bool = True  # off: every request's K chooser uses the calibrated pass costs


DEFAULT_RULES = RoundRules()


class RoundKind(enum.Enum):
    READY = "ready"
    CATCH_UP = "catch-up"
    DRAFT_CALL = "draft"
    FALLBACK = "fallback"
    TARGET_ONLY = "target-only"


@dataclass(frozen=True)
class RoundPlan:
    """What a round will do, decided before it sends anything."""

    kind: RoundKind
    k: int  # the chain's K (a catch-up step's pre-draft drafts up to K); 0 for a tree or target-only
    copy_limit: int  # ProposeRequest.max_copied_tokens: the most a copy may carry (0: none)
    widths: tuple[int, ...]  # a tree's shape, as deep as there is room for; () for a chain
    draft_seed: int
    target_seed: int
    predraft_seed: int
    uniforms: list[float]  # one per position a proposal may fill (a tree's: one per node), drawn whatever it is
    draft_allowed: bool  # the breaker lets rounds call the draft (asked once a round)
    ready: Round | None = None  # READY: the drafts, cut to K
    step_seeds: tuple[int, ...] = ()  # TARGET_ONLY with K fixed at 0: the Verify call's further steps


@dataclass
class RequestState:
    """One request between its rounds: what `plan_round` reads and `commit_round` advances."""

    job: Job
    pair: PairInfo  # the pair's Info as the request began; re-read only when the draft rejects a call
    stats: GenerationStats
    streams: RequestStreams
    sampling: common_pb2.SamplingParams
    sequence: list[int]  # prompt + committed tokens
    text: TextAssembler
    draft_view: SessionView
    target_view: SessionView
    pipelined: bool
    hedging: bool
    retry_until: float  # loop time after which an unavailable target fails the request
    k_chooser: AdaptiveK | None = None  # K per round, when the request left K to the coordinator
    load_aware: bool = False  # the chooser costs rounds at the sessions sharing the services
    copy_chooser: AdaptiveK | None = None  # a copy's length, chosen apart (copies cost no pass)
    refusals: DraftRefusals = field(default_factory=DraftRefusals)
    acceptance: Acceptance = field(default_factory=Acceptance)  # of the model's chain drafts, copies apart
    ready: Round | None = None  # the next round's drafts, from a kept pre-draft or hedge
    branch_failed: bool = False  # the last branch call failed: the next round drafts afresh, never a catch-up
    unused_forks: list[str] = field(default_factory=list)  # draft sessions to end with the next branch call
    copy_wait: int = 0  # K = 0 rounds before a copy is looked for again, after a lookup found none
    predraft_depth: PredraftDepth = field(default_factory=PredraftDepth)  # pre-drafts' steps, from their timing

    @property
    def overlapping(self) -> bool:
        """This round pre-drafts the next during its verify: a pipelined request, unless its
        K chooser costs it beside other sessions on its target (`AdaptiveK.overlaps`)."""
        return self.pipelined and (self.k_chooser is None or self.k_chooser.overlaps)

    @property
    def remaining(self) -> int:
        """New tokens the request may still generate."""
        return self.job.max_new_tokens - len(self.text.token_ids)

    @property
    def finished(self) -> bool:
        return self.text.finish_reason is not None


def k_limit(pair: PairInfo, length: int, remaining: int, most: int | None = None) -> int:
    """The most drafts a round may carry, from a sequence of `length` with `remaining` new
    tokens allowed: room for the drafts plus the recovered/bonus token, in both models, and at
    most `most` (by default the pair's largest K)."""
    room = pair.max_context - length
    most = pair.max_num_speculative_tokens if most is None else most
    return max(0, min(most, remaining - 1, room - 1, pair.draft_max_context - length))


def copy_limit(state: RequestState, pair: PairInfo, k: int) -> int:
    """ProposeRequest.max_copied_tokens for this round, an exact cap (0: no copy; with K = 0
    too, no draft call). A request that fixes K copies at most K; target-only requests (K = 0)
    never copy. A chosen copy may be longer than the largest K (--max-copied-tokens): it runs
    no draft pass, so only the verify grows with it."""
    if not pair.draft_copies or state.job.num_speculative_tokens == 0:
        return 0
    if state.copy_chooser is None:
        return k
    if not k and state.copy_wait:
        return 0  # a copy alone costs a draft call, and the last one found nothing (COPY_WAIT_ROUNDS)
    room = k_limit(pair, len(state.sequence), state.remaining, pair.max_copied_tokens)
    return min(state.copy_chooser.choose(), room)


def catch_up_pays(state: RequestState, k: int) -> bool:
    """Whether a round with no drafts ready should be a catch-up step rather than wait for K
    fresh drafts. A step commits one token in a target pass; a fresh round commits E(K) in K
    draft steps and a verify. Either starts the next round's branches, so the next round is
    about as likely to find drafts ready after both; the step pays where it commits tokens
    faster: 1 / V(0) > E(K) / (D(K) + V(K)), from the calibrated costs and the request's own
    acceptance (never from timing, so a seed still maps to one output). Where a draft step is
    a small share of a target pass (a GPU), a fresh round wins by far; where the draft is
    nearly as slow as the target (these CPUs), the step does. A request's first round is
    always a step: it prefills both models at once. Without measured costs, always a step."""
    costs = state.pair.costs
    if costs is None or not state.draft_view.opened:
        return True
    alpha = state.k_chooser.alpha if state.k_chooser is not None else state.acceptance.alpha
    return costs.tokens_per_ms(0, alpha, pipelined=False) > costs.tokens_per_ms(k, alpha, pipelined=False)


def plan_round(state: RequestState, catch_up: bool, draft_allowed: bool, target_steps: int = 1) -> RoundPlan:
    """The round's kind, K, copy cap, tree and random draws, from the request's state alone
    (its pair too: `RequestState.pair`). `catch_up`: `RoundRules.catch_up`; `draft_allowed`: the
    breaker lets rounds call the draft; `target_steps`: --target-only-steps."""
    pair = state.pair
    limit = k_limit(pair, len(state.sequence), state.remaining)
    shape: tuple[int, ...]
    # A request whose K follows the load starts with a target-only step, copying nothing: its
    # first token then comes after the target's prompt pass alone, never behind the draft's,
    # and its first choice of K sees the requests that arrived with it (a burst's first would
    # see itself alone, draft, and slow every prompt pass beside it on a shared machine).
    first_step = state.k_chooser is not None and state.load_aware and not state.overlapping and not state.stats.rounds
    if first_step:
        k, shape = 0, ()
    elif state.k_chooser is not None:
        k, shape = state.k_chooser.choose_shape()  # shape: a tree's widths, or () for a chain of K
    else:
        k, shape = state.job.num_speculative_tokens, state.job.tree_widths
    k = min(k, limit)
    copy = 0 if shape or first_step else copy_limit(state, pair, k)  # a tree round copies none
    widths = tuple(shape[:limit]) if pair.trees else ()  # a draft restarted as another drafter serves no trees
    fallback = bool(k or copy or widths) and not (state.refusals.allow(state.stats.rounds) and draft_allowed)
    if fallback:
        k, copy, widths = 0, 0, ()  # the draft is down or refused: one target-only step
    draft_seed, target_seed = next_seed(state.streams.draft), next_seed(state.streams.target)
    predraft_seed = next_seed(state.streams.predraft)
    uniforms = state.streams.coins.random(tree_size(widths) or max(k, copy)).tolist()
    ready = state.ready if state.ready is not None and state.ready.draft_token_ids else None
    if ready is not None and k:
        kind = RoundKind.READY
    elif (
        state.overlapping
        and catch_up
        and k
        and not (copy or widths)  # a copy costs no pass; a tree is not pipelined
        and not state.branch_failed
        and draft_allowed
        and catch_up_pays(state, k)
    ):
        kind = RoundKind.CATCH_UP  # rather than leave the target idle while the draft drafts
    elif k or copy or widths:
        kind = RoundKind.DRAFT_CALL
    else:
        kind = RoundKind.FALLBACK if fallback else RoundKind.TARGET_ONLY
    return RoundPlan(
        kind,
        k,
        copy,
        widths,
        draft_seed,
        target_seed,
        predraft_seed,
        uniforms,
        draft_allowed,
        ready.truncated(k) if kind is RoundKind.READY and ready is not None else None,
        step_seeds(state, kind, target_steps),
    )


def step_seeds(state: RequestState, kind: RoundKind, target_steps: int) -> tuple[int, ...]:
    """A request that fixes K = 0 runs up to `target_steps` target-only steps per Verify call:
    the seeds of the steps after the first, drawn from the target's stream as the rounds they
    replace would draw them (a K = 0 request reads no other stream), so the output does not
    depend on `target_steps`. Room is left for the last step's token in the length and the
    context. A request's first round steps once, so its first token comes as soon as the
    prompt's pass ends; so does a tree request served target-only (its next round may
    speculate). A request whose K is chosen steps once too where its seed must keep one output
    (its rounds also read the draft's streams); where its K follows the load (greedy, or
    unseeded) a round the chooser made K = 0 runs the steps as well: under load the calls
    saved are the coordinator's CPU, which a shared machine's target needs."""
    if kind is not RoundKind.TARGET_ONLY or not state.stats.rounds:
        return ()
    if state.k_chooser is not None and not state.load_aware:
        return ()
    if state.k_chooser is None and (state.job.num_speculative_tokens or state.job.tree_widths):
        return ()
    more = min(target_steps - 1, state.remaining - 1, state.pair.max_context - len(state.sequence) - 1)
    return tuple(next_seed(state.streams.target) for _ in range(max(0, more)))


def decide(
    round_: Round,
    verification: target_pb2.VerifyResponse,
    uniforms: list[float],
    relaxed: bool = False,
) -> RoundOutcome | TreeOutcome:
    """The round's accepted drafts and the token after them: chain or tree rejection sampling;
    `relaxed` (`relaxed_round`): the target's relaxed test may keep a chain's drafts too (lossy)."""
    proposed = len(round_.draft_token_ids)
    if round_.parents:  # multi-step speculative sampling (specdec.sampling.tree_sampling)
        return decide_tree(
            verification.draft_token_target_probs,
            round_.draft_token_draft_probs,
            uniforms[:proposed],
            round_.parents,
            verification.recovered_token_ids,
        )
    exact = (
        verification.draft_token_target_probs,
        round_.draft_token_draft_probs,
        uniforms[:proposed],
        verification.recovered_token_ids,
        verification.bonus_token_id,
    )
    if relaxed:
        return decide_round(*exact, relaxed_accepts=verification.relaxed_accepts)
    return decide_round(*exact)


def committed_logprobs(
    outcome: RoundOutcome | TreeOutcome, verification: target_pb2.VerifyResponse
) -> list[common_pb2.TokenLogprobs]:
    """Each committed token's log-probabilities, in the order commit_round takes the tokens
    (the round's, then its steps'); [] where the call carried none. An accepted draft's come
    from its parent position (its own logprob, that position's top tokens), the token after
    them from the last position reached, whose own token it is."""
    if not verification.row_logprobs:
        return []
    if isinstance(outcome, TreeOutcome):
        positions, drafts = [0, *outcome.path], [node - 1 for node in outcome.path]
    else:
        positions, drafts = list(range(outcome.num_accepted + 1)), list(range(outcome.num_accepted))
    rows = verification.row_logprobs
    accepted = [
        common_pb2.TokenLogprobs(
            logprob=verification.draft_token_logprobs[draft],
            top_token_ids=rows[position].top_token_ids,
            top_logprobs=rows[position].top_logprobs,
        )
        for draft, position in zip(drafts, positions)
    ]
    return [*accepted, rows[positions[-1]], *verification.step_logprobs]


def relaxed_round(state: RequestState, round_: Round) -> bool:
    """Whether the round's drafts are verified under the relaxed rule: a relaxed request's
    chain with drafts. A round without drafts (K = 0) has nothing to relax."""
    return state.job.relaxed is not None and bool(round_.draft_token_ids) and not round_.parents


def commit_round(
    state: RequestState,
    plan: RoundPlan,
    round_: Round,
    outcome: RoundOutcome | TreeOutcome,
    max_context: int,
    steps: Sequence[int] = (),
    logprobs: Sequence[common_pb2.TokenLogprobs] = (),
) -> None:
    """Applies a verified round: the stats, the choosers, both session views, and the committed
    tokens (the generation may finish on any of them). `steps`: the tokens of a target-only
    call's further steps (VerifyResponse.step_token_ids), each counted as a round of its own.
    `logprobs`: one per committed token then step (`committed_logprobs`), where asked for."""
    stats, proposed = state.stats, len(round_.draft_token_ids)
    base = len(state.sequence)
    stats.record_round(proposed, outcome.num_accepted, outcome.is_bonus(proposed))
    stats.ready_rounds += round_.source in (Source.PREDRAFT, Source.HEDGE)
    stats.catch_up_rounds += round_.source is Source.CATCH_UP
    stats.fallback_rounds += round_.source is Source.FALLBACK
    stats.tree_rounds += bool(round_.parents)
    stats.foreign_tokens += len(round_.foreign)
    if isinstance(outcome, RoundOutcome):
        stats.relaxed_accepted_tokens += outcome.relaxed_accepted
    if round_.copied:  # from a draft call, a pre-draft or a hedge alike
        stats.copied_rounds += 1
        stats.copied_tokens += proposed
        stats.copied_accepted += outcome.num_accepted
    if state.copy_chooser is not None and round_.copied:
        state.copy_chooser.observe_round(proposed, outcome.num_accepted)  # copies' acceptance apart
    elif state.k_chooser is not None and isinstance(outcome, TreeOutcome):
        state.k_chooser.observe_tree(plan.widths, outcome.path)
    elif state.k_chooser is not None:
        state.k_chooser.observe_round(proposed, outcome.num_accepted)
    if not (round_.copied or round_.parents):
        state.acceptance.observe(proposed, outcome.num_accepted)
    if (
        plan.kind is RoundKind.DRAFT_CALL
        and round_.source is Source.DRAFT  # the call answered (a failed one falls back)
        and plan.copy_limit
        and not (plan.k or plan.widths or round_.copied)
    ):
        state.copy_wait = COPY_WAIT_ROUNDS  # a draft call for a copy alone found none
    elif not (plan.k or plan.copy_limit or plan.widths):
        state.copy_wait = max(0, state.copy_wait - 1)
    # Both services hold sequence + drafts; only the accepted drafts stay valid. After a tree
    # both hold the committed sequence, the nodes cached behind it: the next call's new tokens
    # (the accepted path first) tell them which nodes to keep.
    held = base + (0 if round_.parents else outcome.num_accepted)
    state.target_view.synced = held + len(steps)  # a step feeds the token before it
    if round_.source.in_draft_session:
        state.draft_view.synced = held
    state.ready = None
    entries: Iterator[common_pb2.TokenLogprobs | None] = iter(logprobs) if logprobs else itertools.repeat(None)
    for token in outcome.committed(round_.draft_token_ids):
        state.sequence.append(token)
        if state.text.push(token, next(entries)):
            return
    for token in steps:
        stats.record_round(0, 0)
        state.sequence.append(token)
        if state.text.push(token, next(entries)):
            return
    if len(state.sequence) >= max_context:
        state.text.finish(FINISH_LENGTH)
