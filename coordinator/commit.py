"""A round's commit: `commit_round` applies what the round's calls returned (a frozen
`RoundResult`) and the branches it settled to the request, the one writer of a request's
state (coordinator.rounds.RequestState), and returns the `RoundRecord` its observers read.
No I/O, no clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from coordinator.acceptance import committed_logprobs
from coordinator.features import FeatureRows
from coordinator.pair import PairInfo
from coordinator.round_costs import RoundCosts
from coordinator.rounds import COPY_WAIT_ROUNDS, RequestState, RoundKind, RoundPlan
from coordinator.state import Round, RoundRecord, Settled, Source
from coordinator.text import FINISH_LENGTH
from specdec.sampling.chain import RoundOutcome
from specdec.sampling.tree_sampling import TreeOutcome
from specdec.v1 import common_pb2, target_pb2


@dataclass(frozen=True)
class RoundResult:
    """What a round's calls returned (`coordinator.engine`): its drafts, the verification, the
    outcome decided from them, and what the draft call said about the draft's health."""

    drafts: Round
    verification: target_pb2.VerifyResponse
    outcome: RoundOutcome | TreeOutcome
    draft_took_call: bool = False  # the draft answered the round's call: its refusals start over
    draft_refused: bool = False  # it refused the request (RESOURCE_EXHAUSTED): ask again later
    pair: PairInfo | None = None  # the pair as re-read after the draft rejected the call (None: unchanged)
    features_end: int = 0  # the draft call delivered the request's pending features before this position


def ends_request(state: RequestState, result: RoundResult) -> bool:
    """Whether committing the round will end the request by its tokens alone: a stop token,
    max_new_tokens or the context. (A stop string is found only as the text grows; a request
    it ends settles its branches as if it went on, and ends after.)"""
    tokens = [*result.outcome.committed(result.drafts.draft_token_ids), *result.verification.step_token_ids]
    return (
        any(token in state.pair.eos_token_ids for token in tokens)
        or len(tokens) >= state.remaining
        or len(state.sequence) + len(tokens) >= state.pair.max_context
    )


def commit_round(
    state: RequestState, plan: RoundPlan, result: RoundResult, settled: Settled | None = None
) -> RoundRecord:
    """Applies a verified round, the one writer of the request's state (`RequestState`): the
    draft's health, the choosers, what each service holds, the committed tokens (the
    generation may finish on any of them; a target-only call's further steps each count as a
    round), then the branches the round settled (`settled`; None: it started none)."""
    round_, outcome, verification = result.drafts, result.outcome, result.verification
    proposed, base, index = len(round_.draft_token_ids), len(state.sequence), state.round_index
    max_context = state.pair.max_context  # the pair the round ran with
    if result.pair is not None:  # the one point where a request's pair may change
        state.pair = result.pair
    if result.draft_refused:
        state.refusals.refused(index)
    if result.draft_took_call:
        state.refusals.accepted()
    _observe_choosers(state, plan, round_, outcome)
    # Both services hold sequence + drafts; only the accepted drafts stay valid. After a tree
    # both hold the committed sequence, the nodes cached behind it: the next call's new tokens
    # (the accepted path first) tell them which nodes to keep.
    held = base + (0 if round_.parents else outcome.num_accepted)
    state.target_view.synced = held + len(verification.step_token_ids)  # a step feeds the token before it
    if round_.source.in_draft_session and state.draft_view.opened:  # not if it moved since (it holds nothing)
        state.draft_view.synced = held
        if round_.draft_token_ids and not round_.copied:  # the model drafted them: it ran what they follow
            state.draft_view.modeled = held
    state.ready = None
    tokens, logprobs = outcome.committed(round_.draft_token_ids), committed_logprobs(outcome, verification)
    steps = _append(state, tokens, logprobs, verification.step_token_ids, max_context)
    _keep_features(state, result, settled)
    state.round_index += 1 + steps
    if settled is not None:
        _take_branches(state, settled, plan.costs)
    return RoundRecord(
        round_.source,
        proposed,
        outcome.num_accepted,
        outcome.is_bonus(proposed),
        bool(round_.parents),
        round_.copied,
        len(round_.foreign),
        outcome.relaxed_positions if isinstance(outcome, RoundOutcome) else (),
        steps,
        state.finished,
        state.text.take_delta(),
        min(len(tokens), len(state.sequence) - base),
    )


def _keep_features(state: RequestState, result: RoundResult, settled: Settled | None) -> None:
    """The target's features of the tokens just committed, for the draft's next call, after
    dropping those the round's draft call or branch call delivered (coordinator.features)."""
    delivered = max(result.features_end, settled.features_end if settled is not None else 0)
    if state.features is not None and delivered:
        state.features = state.features.after(delivered)
    if not result.verification.HasField("features"):
        return
    rows = FeatureRows.committed(result.verification.features, len(state.sequence) - 1)
    if rows is not None:
        state.features = rows if state.features is None else state.features.then(rows)


def _observe_choosers(state: RequestState, plan: RoundPlan, round_: Round, outcome: RoundOutcome | TreeOutcome) -> None:
    """The choosers' costs and picks this round, and what its drafts taught them; and how long
    a copy that found nothing keeps copies from being looked for."""
    proposed = len(round_.draft_token_ids)
    if state.k_chooser is not None:
        state.k_chooser.costs = plan.costs or state.k_chooser.costs
        if plan.chosen_k is not None:
            state.k_chooser.observe_choice(plan.chosen_k)
    if state.copy_chooser is not None:
        state.copy_chooser.costs = plan.copy_costs or state.copy_chooser.costs
        if plan.chosen_copy is not None:
            state.copy_chooser.observe_choice(plan.chosen_copy)
    if state.copy_chooser is not None and round_.copied:
        state.copy_chooser.observe_round(proposed, outcome.num_accepted)  # copies' acceptance apart
    elif state.k_chooser is not None and isinstance(outcome, TreeOutcome):
        state.k_chooser.observe_tree(plan.widths, outcome.path)
    elif state.k_chooser is not None:
        state.k_chooser.observe_round(proposed, outcome.num_accepted)
    if not (round_.copied or round_.parents):
        state.acceptance.observe(proposed, outcome.num_accepted)
    if plan.kind is RoundKind.CATCH_UP:
        state.acceptance.caught_up_at = state.acceptance.reached
    if (
        plan.kind is RoundKind.DRAFT_CALL
        and round_.source is Source.DRAFT  # the call answered (a failed one falls back)
        and plan.copy_limit
        and not (plan.k or plan.widths or round_.copied)
    ):
        state.copy_wait = COPY_WAIT_ROUNDS  # a draft call for a copy alone found none
    elif not (plan.k or plan.copy_limit or plan.widths):
        state.copy_wait = max(0, state.copy_wait - 1)


def _append(
    state: RequestState,
    tokens: list[int],
    logprobs: Sequence[common_pb2.TokenLogprobs],
    steps: Sequence[int],
    max_context: int,
) -> int:
    """Commits the round's tokens, then its further steps' (each with its log-probabilities,
    where asked for: `committed_logprobs`), until the generation finishes; returns how many
    steps it committed."""
    entries: Iterator[common_pb2.TokenLogprobs | None] = iter(logprobs) if logprobs else itertools.repeat(None)
    for token in tokens:
        state.sequence.append(token)
        if state.text.push(token, next(entries)):
            return 0
    for committed, token in enumerate(steps, 1):
        state.sequence.append(token)
        if state.text.push(token, next(entries)):
            return committed
    if len(state.sequence) >= max_context:
        state.text.finish(FINISH_LENGTH)
    return len(steps)


def _take_branches(state: RequestState, settled: Settled, costs: RoundCosts | None) -> None:
    """The settled branches: the next round's drafts, the draft session from now on (a used
    fork) and what it holds, the pre-drafts' depth, the chooser's hedge rescues, and the call's
    time with the round's `costs` (the coordinator's row cost learns from both as it ends)."""
    if settled.draft_view is not None:
        state.draft_view = settled.draft_view
    if settled.draft_synced is not None:
        state.draft_view.synced = settled.draft_synced
    if settled.synced_at_least is not None:
        state.draft_view.synced = max(state.draft_view.synced, settled.synced_at_least)
    if settled.slack_ms is not None and not state.job.seeded_sampled:
        # How long before the verify the branches replied: the next pre-draft's steps.
        step_ms = state.pair.costs.draft_step_ms() if state.pair.costs else 0.0
        state.predraft_depth.observe(settled.slack_ms, step_ms, settled.predraft_full)
    if settled.timing is not None and costs is not None:  # the coordinator's row cost, as it ends
        state.branch_calls.append((costs, *settled.timing))
    if state.k_chooser is not None and settled.rescued is not None:
        state.k_chooser.observe_rescue(settled.rescued)  # for the chooser's ρ
    if state.k_chooser is not None and settled.guessed is not None and state.job.params.greedy:
        # A greedy catch-up's guess is one draft, accepted or not. Without it a request whose
        # rounds all catch up (their pre-drafts all missing) never learns its α: it stayed at its
        # prior on one H200 with random weights, every round a catch-up, at 0.49x target-only.
        # Not a sampled one's: its guess, the draft's likeliest token, is the target's draw with
        # p(guess), below α = Σ min(p, q) for a good draft (a draft that is its target fell to
        # α 0.37 and K = 0 on them); such a request verifies a draft before it catches up again
        # (rounds.catch_up_pays).
        state.k_chooser.observe_round(1, int(settled.guessed))
    # A catch-up whose call failed (a restarted draft: NOT_FOUND) must not be retried as one:
    # the regular draft call re-prefills and counts failures.
    state.branch_failed = settled.failed
    if settled.refused:  # a branch refused is a refusal like any draft call's
        state.refusals.refused(state.round_index)
    if settled.ready is not None:
        state.ready = settled.ready
        state.refusals.accepted()  # the draft took the branch's call
