"""Where a round's drafts come from: the one interface the round asks.

A round asks two things of its drafting, and nothing else (coordinator.engine):
- its own drafts, before the verify (`Drafting.draft`), from the source its plan's kind names
  (`sources()`): drafts kept from the last round's branches (a pre-draft, a hedge, a bonus
  guess's fork), a draft call (the draft service's model, copies or tree, one Propose), or none
  (a catch-up step, a round the breaker or a refusal runs target-only, K = 0);
- the next round's, during the verify (`Drafting.start_branches`, settled by the outcome in
  `Drafting.settle`): the pre-draft and hedges of coordinator.branches.

Each source returns a frozen `Drafted`: the drafts with the distributions they were drawn from,
and what the call said of the draft's health; commit_round applies it (coordinator.commit). A
source writes none of what commit_round owns (the draft call adds its cost to the stats, an
observer's part, and its answer to the replica's breaker). A new kind of drafter is a source in
`sources()`; where it needs the target's say (an EAGLE-style head reads the target's hidden
features of the tokens a verify accepted), that is a field of the verification commit_round
keeps for the source's next call, since every source is handed the request's state as last
committed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from coordinator.branches import BranchCall, Branches
from coordinator.clients import CallRejected
from coordinator.commit import RoundResult, ends_request
from coordinator.pair import PairInfo
from coordinator.rounds import RequestState, RoundDraws, RoundKind, RoundPlan, k_limit
from coordinator.state import Round, Settled, Source
from coordinator.upstream import Upstream
from specdec.errors import ResourceExhausted, ServiceRefused, Unavailable
from specdec.sampling.tree_sampling import tree_size


@dataclass(frozen=True)
class Drafted:
    """A round's drafts, and what the draft call (if any) said of the draft."""

    round: Round
    took: bool = False  # the draft answered the round's call: its refusals start over
    refused: bool = False  # it refused the request (RESOURCE_EXHAUSTED): ask again later
    pair: PairInfo | None = None  # re-read after the draft rejected the call (None: unchanged)
    features_end: int = 0  # the call delivered the request's pending features before this position


class DraftSource(Protocol):
    """A round's drafts of one kind (`sources()`): reads the request's state, writes none of what
    commit_round owns (the module docstring)."""

    async def draft(self, state: RequestState, plan: RoundPlan, draws: RoundDraws) -> Drafted: ...


class Kept:
    """The drafts a branch of the last round's call left ready (the plan holds them, cut to K)."""

    async def draft(self, state: RequestState, plan: RoundPlan, draws: RoundDraws) -> Drafted:
        assert plan.ready is not None
        return Drafted(plan.ready)


@dataclass(frozen=True)
class Nothing:
    """No draft call: the verify alone, its drafts of this source (a catch-up step, a fallback,
    a target-only round)."""

    source: Source

    async def draft(self, state: RequestState, plan: RoundPlan, draws: RoundDraws) -> Drafted:
        return Drafted(Round(self.source))


@dataclass(frozen=True)
class DraftCall:
    """One Propose to the request's draft replica: the model's chain, a copy, or a tree. A
    call the draft cannot take leaves the round target-only (`Source.FALLBACK`)."""

    upstream: Upstream

    async def draft(self, state: RequestState, plan: RoundPlan, draws: RoundDraws) -> Drafted:
        pair = state.pair
        try:
            proposal = await self.upstream.propose(
                state.draft_view,
                state.sequence,
                plan.k,
                state.sampling,
                draws.draft_seed,
                state.stats,
                pair,
                # Always said (0: none): a draft that copies though its Info did not say so (a
                # replica of a mixed pool, one restarted as prompt lookup) would copy up to K.
                max_copied=None if plan.widths else (plan.copy_limit if pair.draft_copies else 0),
                tree_widths=plan.widths,
                features=state.features.message() if state.features is not None else None,
            )
        except (Unavailable, CallRejected, ResourceExhausted, ServiceRefused) as exc:
            # Target-only for this round: the same output, only slower. Not only UNAVAILABLE: a
            # draft restarted with other capabilities rejects calls it used to take, or with
            # another token refuses the coordinator (its session moves where one serves), one short of
            # sessions or memory refuses this request (target-only rounds, then it asks again:
            # DraftRefusals), and the draft only ever speeds a request up. A broken draft (NaN
            # logits: INTERNAL) still fails the request, loudly (tests/integration/test_guards.py).
            self.upstream.draft_failed(exc, state.draft_view, state.stats)
            reread = None
            if isinstance(exc, CallRejected):
                # The one point where a request's pair may change: a draft restarted with other
                # capabilities (no trees, no copies, a lower K) rejects what this request's
                # snapshot allowed, so the request takes the Info read after the rejection.
                reread = await self.upstream.reread_pair(state.draft_view)
            return Drafted(Round(Source.FALLBACK), refused=isinstance(exc, ResourceExhausted), pair=reread)
        assert state.draft_view.replica is not None  # it answered the call
        state.draft_view.replica.breaker.record_success()
        state.stats.draft_compute_ms += proposal.compute_ms
        k = tree_size(plan.widths) or (plan.copy_limit if proposal.copied else plan.k)
        return Drafted(
            self.upstream.round_from(proposal, k, state.draft_view.address),
            took=True,
            features_end=state.features.end if state.features is not None else 0,
        )


def sources(upstream: Upstream) -> dict[RoundKind, DraftSource]:
    """Each round kind's source of drafts."""
    return {
        RoundKind.READY: Kept(),
        RoundKind.DRAFT_CALL: DraftCall(upstream),
        RoundKind.CATCH_UP: Nothing(Source.CATCH_UP),
        RoundKind.FALLBACK: Nothing(Source.FALLBACK),
        RoundKind.TARGET_ONLY: Nothing(Source.NONE),
    }


class Drafting:
    """A request's drafts for each round, and the next round's branches during its verify."""

    def __init__(self, upstream: Upstream, branches: Branches) -> None:
        self.sources = sources(upstream)
        self.branches = branches

    async def draft(self, state: RequestState, plan: RoundPlan, draws: RoundDraws) -> Drafted:
        """The round's drafts, from the source its plan's kind names."""
        return await self.sources[plan.kind].draft(state, plan, draws)

    def start_branches(
        self, state: RequestState, plan: RoundPlan, draws: RoundDraws, round_: Round
    ) -> BranchCall | None:
        """The branches to draft during the verify: a pre-draft (pipelined) and hedges, when the
        round speculates and a fully accepted round would leave room for another. A catch-up
        step's pre-draft carries the tokens the draft session lacks, guesses the step's token
        and drafts up to K after it (no hedges: there are no runner-ups to hedge on)."""
        catch_up = plan.kind is RoundKind.CATCH_UP
        proposed = len(round_.draft_token_ids)
        hedging = state.hedging and (plan.overlapping or not state.overlap.chosen)  # auto's: only pre-drafting
        if not ((plan.overlapping or hedging) and plan.k and (proposed or catch_up) and plan.draft_allowed):
            return None
        # Room after a fully accepted round: the bonus guess plus up to K drafts for it (K - 1
        # where that last step comes back after the verify: PredraftDepth).
        pair = state.pair
        next_limit = k_limit(pair, len(state.sequence) + proposed + 1, state.remaining - proposed - 1)
        most = min(plan.k, next_limit)
        predraft_k = state.predraft_depth.steps(most) if plan.overlapping and next_limit else 0
        hedge_k = plan.k if hedging else 0
        call = self.branches.start(state, pair, round_, predraft_k, hedge_k, draws.predraft_seed, catch_up)
        if call is not None:
            call.predraft_full = predraft_k == most + 1
        return call

    async def settle(self, state: RequestState, call: BranchCall, result: RoundResult) -> Settled:
        """What the branch call left: the branch the outcome selected (if any) as the next
        round's drafts, and what commit_round learns from the call."""
        outcome, proposed = result.outcome, len(result.drafts.draft_token_ids)
        live = not ends_request(state, result)
        settled = await self.branches.settle(
            call, outcome, proposed, live, state.draft_view, len(state.sequence), state.stats, state.unused_forks,
            state.round_index,
        )  # fmt: skip
        replied, verified, slack, timing = call.replied_ms, call.verified_ms, None, None
        if call.predraft is not None and replied is not None and verified is not None:
            slack = verified - replied
        if call.predraft is not None and replied is not None and len(call.branches) > 1:
            timing = (len(call.branches), max(branch.k for branch in call.branches), replied - call.sent_ms)
        rescued = None
        if call.hedged and outcome.num_accepted < proposed:
            # A rejection: whether a hedge assumed it (the outcome and the plan alone decide, as for K).
            rescued = call.hedge_for(outcome.num_accepted, outcome.next_token_id) is not None
        task = call.task
        delivered = task.done() and not task.cancelled() and task.exception() is None  # its features too
        return dataclasses.replace(
            settled,
            slack_ms=slack,
            timing=timing,
            predraft_full=call.predraft_full,
            rescued=rescued,
            features_end=call.features_end if delivered else 0,
        )
