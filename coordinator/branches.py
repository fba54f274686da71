"""Pre-drafts and hedges: the branches the draft drafts during a verify, one for each
likely outcome of the round, and how the round that follows picks one (by the verification
outcome alone, which keeps the output exact)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from opentelemetry import trace

from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.hedging import Hedge, acceptance_estimate, plan_hedges
from coordinator.metrics import GenerationStats
from coordinator.requests import PairInfo
from coordinator.seeds import next_seed
from coordinator.state import Round, SessionView, check_reply
from specdec.errors import ResourceExhausted, SpecDecError
from specdec.v1 import draft_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BranchPlan:
    """One branch of a speculation: the pre-draft (`hedge` None: the request's own draft
    session continues as if every draft is accepted) or a hedge (a fork assuming `hedge`)."""

    k: int
    session_id: str
    hedge: Hedge | None = None


@dataclass
class Speculation:
    """The branches drafted during one verify, in one ProposeBranches call, so the draft
    steps them all in the same forward passes. Tagged with the round that started it: it is
    settled before the next round begins, and offering it to any other round is a bug."""

    round_index: int
    branches: list[BranchPlan]
    task: asyncio.Future  # the ProposeBranches call
    failed: bool = False  # set when its reply was read: the call or the pre-draft's branch failed
    refused: bool = False  # of those failures, RESOURCE_EXHAUSTED: the draft cannot hold the request

    @property
    def predraft(self) -> BranchPlan | None:
        return next((b for b in self.branches if b.hedge is None), None)

    @property
    def forks(self) -> list[BranchPlan]:
        return [b for b in self.branches if b.hedge is not None]

    def cancel(self) -> None:
        """Cancels the RPC (the draft stops every branch at its next step); a reply that
        already arrived is dropped unread."""
        self.task.cancel()
        # Retrieve any exception so asyncio does not log it as never retrieved.
        self.task.add_done_callback(lambda task: task.cancelled() or task.exception())


class Branching:
    """The Coordinator's pre-draft and hedge steps (a mixin: they share its clients and state)."""

    config: CoordinatorConfig
    pair: PairInfo
    draft: DraftClient
    _k_limit: Callable[[int, int], int]
    _round_from: Callable[[draft_pb2.ProposeResponse, int], Round]
    _end_later: Callable[[DraftClient | TargetClient, str], None]

    def _start_speculation(
        self,
        draft_view: SessionView,
        sequence: list[int],
        round_: Round,
        predraft_k: int,
        hedge_k: int,
        remaining: int,
        sampling,
        predraft_seed: int,
        hedge_seeds: np.random.Generator,
        stats: GenerationStats,
        catch_up: bool = False,
    ) -> Speculation | None:
        """Starts, while the target verifies, one ProposeBranches call drafting the next round
        for the likeliest outcomes of this one, all branches stepped in the same passes:

        - the pre-draft (`predraft_k` > 0): the draft session, which holds `sequence` plus this
          round's drafts, continues for the bonus guess plus up to predraft_k - 1 drafts;
        - hedges (`hedge_k` > 0): forks of the session for the likeliest rejection outcomes
          "draft j rejected, token t recovered" (coordinator.hedging), each drafting the round
          that would follow. They are listed first, so they copy the session before the
          pre-draft extends it and share its passes.

        `catch_up`: this round runs target-only and its drafts are not in the draft session; the
        pre-draft first appends the committed tokens the session lacks (opening it on a
        request's first round), then guesses the step's token and drafts after it.
        """
        plans: list[BranchPlan] = []
        requests: list[draft_pb2.ProposeRequest] = []
        base = len(sequence)
        if hedge_k and round_.runner_up_ids:  # prompt lookup has no distributions to hedge on
            alpha = acceptance_estimate(*stats.drafted_acceptance())  # the model's drafts: copies apart
            for hedge in plan_hedges(
                round_.runner_up_ids, round_.runner_up_probs, alpha, self.config.hedges, self.pair.eos_token_ids
            ):
                limit = self._k_limit(base + hedge.position + 1, remaining - hedge.position - 1)
                if not limit:
                    continue
                plans.append(BranchPlan(min(hedge_k, limit), uuid.uuid4().hex, hedge))
                requests.append(
                    draft_pb2.ProposeRequest(
                        session_id=plans[-1].session_id,
                        fork_from=draft_view.session_id,
                        keep_tokens=base + hedge.position,
                        new_tokens=[hedge.recovered_token_id],
                        num_tokens=plans[-1].k,
                        sampling=sampling,
                        seed=next_seed(hedge_seeds),
                        **draft_view.draft_fields(),
                    )
                )
        if predraft_k:
            plans.append(BranchPlan(min(predraft_k, self.pair.max_num_speculative_tokens), draft_view.session_id))
            # The session holds the sequence and this round's drafts: nothing to send (a
            # catch-up sends what the session lacks).
            keep, new_tokens = base + len(round_.draft_token_ids), []
            if catch_up:
                keep, new_tokens = draft_view.synced, self.pair.for_draft(sequence[draft_view.synced :])
                draft_view.opened = True
            requests.append(
                draft_pb2.ProposeRequest(
                    session_id=draft_view.session_id,
                    keep_tokens=keep,
                    new_tokens=new_tokens,
                    num_tokens=plans[-1].k,
                    sampling=sampling,
                    seed=predraft_seed,
                    **draft_view.draft_fields(),
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
        return Speculation(round_index=stats.rounds, branches=plans, task=task)

    async def _settle(
        self,
        speculation: Speculation,
        outcome,
        proposed: int,
        live: bool,
        draft_view: SessionView,
        base: int,
        stats: GenerationStats,
    ) -> tuple[Round | None, str, SessionView]:
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
        hit: BranchPlan | None = None
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
            speculation.failed = True
            speculation.refused = isinstance(exc, ResourceExhausted)
            self._drop(speculation)
            stats.predraft_cancelled += speculation.predraft is not None
            return None, "", draft_view
        finally:
            stats.branch_wait_ms += stats.elapsed_ms() - waited_from
        check_reply(self.draft.address, "branch results", len(reply.results), len(speculation.branches))
        taken: Round | None = None
        for plan, result in zip(speculation.branches, reply.results):
            failed = result.error_code != 0
            if failed:
                logger.info(
                    "branch %s failed (status %d): %s", plan.session_id, result.error_code, result.error_message
                )
                branch = Round()
            else:
                branch = self._round_from(result.proposal, plan.k)
            if plan.hedge is None:
                speculation.failed = failed
                speculation.refused = result.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
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
                    if plan is hit and not failed:
                        # It ran, so the session holds the round's committed prefix (a catch-up
                        # sent it): the next call need not send that again.
                        draft_view.synced = max(draft_view.synced, base + proposed)
            elif plan is hit and not failed:
                trace.get_current_span().add_event(
                    "hedge.used",
                    {"specdec.position": plan.hedge.position, "specdec.tokens": len(branch.draft_token_ids)},
                )
                stats.hedge_hits += 1
                stats.hedged_tokens += len(branch.draft_token_ids)
                taken = branch
                self._end_later(self.draft, draft_view.session_id)
                draft_view = SessionView(
                    plan.session_id,
                    synced=base + outcome.num_accepted + 1,
                    opened=True,
                    calls=draft_view.calls,
                    min_confidence=draft_view.min_confidence,
                    vocab_limit=draft_view.vocab_limit,
                )
            else:
                stats.hedge_wasted_tokens += len(branch.draft_token_ids)
                self._end_later(self.draft, plan.session_id)
        return taken, ("predraft" if hit.hedge is None else "hedge"), draft_view

    def _drop(self, speculation: Speculation) -> None:
        """Cancels the branches' call and frees their forks (the pre-draft's session is the request's)."""
        speculation.cancel()
        for plan in speculation.forks:
            self._end_later(self.draft, plan.session_id)
