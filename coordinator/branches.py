"""Pre-drafts and hedges: the branches the draft drafts during a verify, one for each
likely outcome of the round, and how the round that follows picks one (by the verification
outcome alone, which keeps the output exact)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import cast

import grpc
from opentelemetry import trace

from coordinator.clients import DraftClient
from coordinator.hedging import Hedge, plan_hedges
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo
from coordinator.replica import Replica, held_in
from coordinator.rounds import RequestState, k_limit
from coordinator.state import Round, SessionView, Settled, Source, check_reply
from coordinator.upstream import Upstream
from specdec.errors import ResourceExhausted, SpecDecError
from specdec.rpc import wire
from specdec.sampling.chain import RoundOutcome
from specdec.sampling.seeds import next_seed
from specdec.sampling.tree_sampling import TreeOutcome
from specdec.v1 import draft_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BranchPlan:
    """One branch of a speculation: the pre-draft (`hedge` None: the request's own draft
    session continues as if every draft is accepted, guessing the bonus token by the draft's
    argmax), a fork guessing it by the draft's runner-up of rank `guess_rank` (--bonus-guesses),
    or a hedge (a fork assuming `hedge`)."""

    k: int
    session_id: str
    hedge: Hedge | None = None
    guess_rank: int = 0

    @property
    def guesses(self) -> bool:
        """It continues a fully accepted round: the pre-draft or a fork guessing otherwise."""
        return self.hedge is None

    @property
    def forked(self) -> bool:
        return self.hedge is not None or self.guess_rank > 0


@dataclass
class BranchCall:
    """The branches drafted during one verify, in one ProposeBranches call in flight, so the
    draft steps them all in the same forward passes. Tagged with the round that started it: it
    is settled before the next round begins, and offering it to any other round is a bug."""

    round_index: int
    branches: list[BranchPlan]
    task: asyncio.Future  # the ProposeBranches call
    replica: Replica  # the draft replica the call went to, where its forks live
    ending: tuple[str, ...] = ()  # the unused forks of earlier calls that this call ends
    epoch: int = 0  # the newest call number it sent: its forks, ended, are retired up to it
    # Request times (GenerationStats.elapsed_ms) it was sent, replied (None: not yet, failed or
    # cancelled) and its verify answered: PredraftDepth's slack, coordinator.overlap.RowCost's time.
    sent_ms: float = 0.0
    replied_ms: float | None = None
    verified_ms: float | None = None
    predraft_full: bool = True  # its pre-draft took k + 1 steps (PredraftDepth.steps)
    features_end: int = 0  # it carries the request's pending features (coordinator.features) before this position

    @property
    def predraft(self) -> BranchPlan | None:
        return next((b for b in self.branches if b.guesses and not b.forked), None)

    @property
    def forks(self) -> list[BranchPlan]:
        """Branches on sessions of their own, which end when unused."""
        return [b for b in self.branches if b.forked]

    @property
    def hedged(self) -> bool:
        return any(b.hedge is not None for b in self.branches)

    def hedge_for(self, num_accepted: int, next_token_id: int) -> BranchPlan | None:
        """The fork that assumed exactly this rejection: draft `num_accepted` rejected and
        `next_token_id` recovered."""
        assumed = (num_accepted, next_token_id)
        hedges = (b for b in self.forks if b.hedge and (b.hedge.position, b.hedge.recovered_token_id) == assumed)
        return next(hedges, None)

    def cancel(self) -> None:
        """Cancels the RPC (the draft stops every branch at its next step); a reply that
        already arrived is dropped unread."""
        self.task.cancel()  # and its exception retrieved, so asyncio does not log it as never retrieved:
        self.task.add_done_callback(lambda task: task.cancelled() or task.exception())


class Branches:
    """Pre-drafts, hedges and catch-up pre-drafts: started during a verify, settled on its outcome."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def start(
        self,
        state: RequestState,
        pair: PairInfo,
        round_: Round,
        predraft_k: int,
        hedge_k: int,
        predraft_seed: int,
        catch_up: bool = False,
    ) -> BranchCall | None:
        """Starts, while the target verifies, one ProposeBranches call drafting the next round
        for the likeliest outcomes of this one, all branches stepped in the same passes:

        - the pre-draft (`predraft_k` > 0): the draft session, which holds the sequence plus
          this round's drafts, continues for the bonus guess plus up to predraft_k - 1 drafts;
        - hedges (`hedge_k` > 0): forks of the session for the likeliest rejection outcomes
          "draft j rejected, token t recovered" (coordinator.hedging), each drafting the round
          that would follow. They are listed first, so they copy the session before the
          pre-draft extends it and share its passes.

        `catch_up`: this round runs target-only and its drafts are not in the draft session; the
        pre-draft first appends the committed tokens the session lacks (opening it on a
        request's first round), then guesses the step's token and drafts after it."""
        draft_view = state.draft_view
        if not (catch_up or draft_view.opened):  # moved to another replica since it drafted: nothing to branch from
            return None
        branches: list[tuple[BranchPlan, draft_pb2.ProposeRequest]] = []
        if hedge_k and round_.runner_up_ids:  # prompt lookup has no distributions to hedge on
            branches += self._hedges(state, pair, round_, hedge_k)
        if predraft_k and round_.runner_up_ids:  # drafted by the model, which guesses again
            branches += self._guesses(state, pair, round_, predraft_k)
        if predraft_k:
            branches.append(self._predraft(state, pair, round_, predraft_k, predraft_seed, catch_up))
        plans, requests = [plan for plan, _ in branches], [request for _, request in branches]
        if not plans:
            return None
        # Numbered after every call the session has served, so none is refused as stale; the
        # session's next regular call is numbered after these.
        for request in requests:
            request.epoch = next(draft_view.calls)
            if state.features is not None:  # an EAGLE-style draft's: each branch's session reads them
                request.features.CopyFrom(state.features.message())
        state.stats.predrafts += predraft_k > 0
        state.stats.hedges += sum(plan.hedge is not None for plan in plans)
        return self._call(state, plans, requests)

    def _call(
        self, state: RequestState, plans: list[BranchPlan], requests: list[draft_pb2.ProposeRequest]
    ) -> BranchCall:
        """Sends the branches' one ProposeBranches call; its times are kept on the call."""
        draft_view, stats = state.draft_view, state.stats
        # Earlier rounds' unused forks end in this call (any past the first few: EndSession calls).
        self.end_now(state.unused_forks[wire.MAX_ENDED_SESSIONS :], draft_view)
        ending = tuple(state.unused_forks[: wire.MAX_ENDED_SESSIONS])
        state.unused_forks[:] = ending
        call = draft_pb2.ProposeBranchesRequest(branches=requests, end_session_ids=ending)

        async def timed() -> draft_pb2.ProposeBranchesResponse:  # not a done callback: settle may read first
            reply = await cast(DraftClient, draft_view.client).propose_branches(call)
            branch_call.replied_ms = stats.elapsed_ms()
            branch_call.replica.answered(draft_view.session_id, held_in(reply))
            return reply

        assert draft_view.replica is not None
        epoch = max(request.epoch for request in requests)
        task = asyncio.ensure_future(timed())
        branch_call = BranchCall(state.round_index, plans, task, draft_view.replica, ending, epoch, stats.elapsed_ms())
        branch_call.features_end = state.features.end if state.features is not None else 0
        return branch_call

    def _predraft(
        self, state: RequestState, pair: PairInfo, round_: Round, predraft_k: int, seed: int, catch_up: bool
    ) -> tuple[BranchPlan, draft_pb2.ProposeRequest]:
        """The request's own draft session, continued past this round's drafts: the bonus
        guess, then drafts. The session holds the sequence and the round's drafts, so nothing
        is sent; a catch-up sends what the session lacks (and opens it)."""
        draft_view = state.draft_view
        plan = BranchPlan(min(predraft_k, pair.max_num_speculative_tokens), draft_view.session_id)
        keep, new_tokens = len(state.sequence) + len(round_.draft_token_ids), []
        if catch_up:
            keep, new_tokens = draft_view.synced, pair.for_draft(state.sequence[draft_view.synced :])
            draft_view.opened = True
        request = draft_pb2.ProposeRequest(
            session_id=draft_view.session_id,
            keep_tokens=keep,
            new_tokens=new_tokens,
            num_tokens=plan.k,
            sampling=state.sampling,
            seed=seed,
            guess_first=True,  # the bonus guess: only compared with the bonus token
            **draft_view.draft_fields(),
        )
        return plan, request

    def _hedges(
        self, state: RequestState, pair: PairInfo, round_: Round, hedge_k: int
    ) -> list[tuple[BranchPlan, draft_pb2.ProposeRequest]]:
        """Forks of the draft session for the likeliest rejection outcomes, each drafting the
        round that would follow. Room for a next round after a rejection at j shrinks with j:
        only the positions that leave some are hedged, so the best outcomes are chosen among
        those."""
        draft_view, base = state.draft_view, len(state.sequence)
        limits = [k_limit(pair, base + j + 1, state.remaining - j - 1) for j in range(len(round_.runner_up_ids))]
        positions = next((j for j, limit in enumerate(limits) if not limit), len(limits))
        hedges = plan_hedges(
            round_.runner_up_ids[:positions],
            round_.runner_up_probs[:positions],
            state.acceptance.alpha,
            state.overlap.hedges,
            pair.eos_token_ids,
        )
        branches = []
        for hedge in hedges:
            plan = BranchPlan(min(hedge_k, limits[hedge.position]), uuid.uuid4().hex, hedge)
            request = draft_pb2.ProposeRequest(
                session_id=plan.session_id,
                fork_from=draft_view.session_id,
                keep_tokens=base + hedge.position,
                new_tokens=[hedge.recovered_token_id],
                num_tokens=plan.k,
                sampling=state.sampling,
                seed=next_seed(state.streams.hedge),
                **draft_view.draft_fields(),
            )
            branches.append((plan, request))
        return branches

    def _guesses(
        self, state: RequestState, pair: PairInfo, round_: Round, predraft_k: int
    ) -> list[tuple[BranchPlan, draft_pb2.ProposeRequest]]:
        """The bonus token guessed by the draft's runner-ups after the round's last draft
        (--bonus-guesses), each on a fork of the session as the round left it (listed before
        the pre-draft extends it), stepped beside the pre-draft's own guess."""
        draft_view = state.draft_view
        branches = []
        for rank in range(1, state.overlap.bonus_guesses):
            plan = BranchPlan(min(predraft_k, pair.max_num_speculative_tokens), uuid.uuid4().hex, guess_rank=rank)
            request = draft_pb2.ProposeRequest(
                session_id=plan.session_id,
                fork_from=draft_view.session_id,
                keep_tokens=len(state.sequence) + len(round_.draft_token_ids),
                num_tokens=plan.k,
                sampling=state.sampling,
                seed=next_seed(state.streams.hedge),
                guess_first=True,
                guess_rank=rank,
                **draft_view.draft_fields(),
            )
            request.max_copied_tokens = 0  # the model guesses, never a copy (any draft that copies)
            branches.append((plan, request))
        return branches

    async def pick(
        self, call: BranchCall, outcome: RoundOutcome | TreeOutcome, proposed: int, live: bool
    ) -> BranchPlan | None:
        """The branch the round's outcome selects, if any: the pre-draft when every draft was
        accepted (it, or a fork guessing the bonus token by a runner-up, is used only if its
        guess then equals the bonus token, checked once the reply is read), the hedge that
        assumed exactly this rejection and recovered token, or none when the generation has
        finished. The outcome alone decides, never the branches'
        draws: that is what keeps the output exact (the argument in `Engine.generate`). Tests
        replace this rule with wrong ones to show the distribution tests catch them."""
        if not live:
            return None
        if outcome.num_accepted == proposed:
            return call.predraft
        return call.hedge_for(outcome.num_accepted, outcome.next_token_id)

    async def settle(
        self,
        call: BranchCall,
        outcome: RoundOutcome | TreeOutcome,
        proposed: int,
        live: bool,
        draft_view: SessionView,
        base: int,
        stats: GenerationStats,
        unused: list[str],
        round_index: int,
    ) -> Settled:
        """The next round's drafts, if a branch assumed the outcome that happened (`pick`), and
        the draft session to use from now on. A branch so chosen holds the committed prefix
        and drafts drawn from the draft given exactly that prefix, before the next round's
        coins exist; the next round verifies them against the distributions they came from.
        Unused forks join `unused`, which the next branch call ends; when a fork is used, it
        becomes the request's draft session and the old one joins them. The forks this
        call ended leave `unused` once its reply is read; a call cancelled or failed may not
        have ended them, so they stay and go again with the next (ending is idempotent)."""
        if call.round_index != round_index:
            raise AssertionError(f"branches of round {call.round_index} offered to round {round_index}")
        hit = await self.pick(call, outcome, proposed, live)
        if hit is None:
            self.drop(call, unused)
            return Settled()
        waited_from = stats.elapsed_ms()
        try:
            reply = await call.task
        except SpecDecError as exc:
            logger.info("pre-draft/hedge call failed, drafting afresh (or falling back): %s", exc)
            stats.branch_failures += len(call.branches)  # every branch of it
            self.drop(call, unused)
            return Settled(failed=True, refused=isinstance(exc, ResourceExhausted))
        finally:
            stats.branch_wait_ms += stats.elapsed_ms() - waited_from
        check_reply(call.replica.address, "branch results", len(reply.results), len(call.branches))
        unused[:] = [session_id for session_id in unused if session_id not in call.ending]
        return self._take(call, reply, hit, outcome, proposed, draft_view, base, stats, unused)

    def _take(
        self,
        call: BranchCall,
        reply: draft_pb2.ProposeBranchesResponse,
        hit: BranchPlan,
        outcome: RoundOutcome | TreeOutcome,
        proposed: int,
        draft_view: SessionView,
        base: int,
        stats: GenerationStats,
        unused: list[str],
    ) -> Settled:
        """Reads every branch's reply: the chosen branch's drafts become the next round's, the rest
        are counted and their forks join `unused`. After a fully accepted round the chosen branch is
        the first, by rank, whose guess (its first token) is the bonus token; what the request's
        draft session holds now is in the Settled."""
        branches, errors = self._read(call, reply)
        chosen = chosen_branch(call, hit, branches, errors, outcome.next_token_id)
        used = Settled()
        failed = refused = False
        predraft = call.predraft
        for plan, branch, result, error in zip(call.branches, branches, reply.results, errors):
            stats.branch_failures += error != 0
            if plan.guesses:
                stats.predraft_compute_ms += result.proposal.compute_ms if not error else 0.0
                stats.predrafted_tokens += len(branch.draft_token_ids)
            if plan is predraft:
                failed = error != 0
                refused = error == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            if plan is chosen:
                synced = base + (proposed if plan.guesses else outcome.num_accepted) + 1
                used = self._use(plan, branch, synced, draft_view, stats, unused)
                continue
            if plan.guesses:
                stats.predraft_wasted_tokens += len(branch.draft_token_ids)
            else:
                stats.hedge_wasted_tokens += len(branch.draft_token_ids)
            if plan.forked:
                unused.append(plan.session_id)
        at_least = None
        if hit.guesses and chosen is None:
            stats.predraft_misses += 1
            if predraft is not None and not failed:
                at_least = base + proposed  # it ran: the session holds the round's committed prefix
        guess = branches[call.branches.index(predraft)].draft_token_ids[:1] if predraft and not failed else []
        guessed = guess == [outcome.next_token_id] if predraft and not (failed or proposed) else None  # a catch-up's
        return dataclasses.replace(used, synced_at_least=at_least, failed=failed, refused=refused, guessed=guessed)

    def _read(self, call: BranchCall, reply: draft_pb2.ProposeBranchesResponse) -> tuple[list[Round], list[int]]:
        """Each branch's drafts (none where it failed) and its gRPC status code (0: it did not fail)."""
        branches: list[Round] = []
        errors: list[int] = []
        for plan, result in zip(call.branches, reply.results):
            source = Source.PREDRAFT if plan.guesses else Source.HEDGE
            branch, error, message = Round(source), result.error_code, result.error_message
            if error:
                logger.info("branch %s failed (status %d): %s", plan.session_id, error, message)
            else:
                branch = self.upstream.round_from(result.proposal, plan.k, call.replica.address, source)
            branches.append(branch)
            errors.append(error)
        return branches, errors

    @staticmethod
    def _use(
        plan: BranchPlan, branch: Round, synced: int, draft_view: SessionView, stats: GenerationStats, unused: list[str]
    ) -> Settled:
        """The chosen branch: its drafts as the next round's, the session that holds `synced`
        committed tokens (a fork becomes the request's, the old session joins `unused`)."""
        if plan.guesses:
            trace.get_current_span().add_event(
                "predraft.used", {"specdec.tokens": len(branch.draft_token_ids) - 1, "specdec.rank": plan.guess_rank}
            )
            stats.predraft_hits += 1
            stats.bonus_guess_hits += plan.forked
            # The branch holds the round, the bonus token (= its guess) and the rest of its
            # drafts, which become the next round's.
            taken = branch.truncated(len(branch.draft_token_ids), start=1)
        else:
            assert plan.hedge is not None
            trace.get_current_span().add_event(
                "hedge.used", {"specdec.position": plan.hedge.position, "specdec.tokens": len(branch.draft_token_ids)}
            )
            stats.hedge_hits += 1
            stats.hedged_tokens += len(branch.draft_token_ids)
            taken = branch
        fork = None
        if plan.forked:
            unused.append(draft_view.session_id)
            # The request's session from now on: the fork, where it was forked, with the
            # request's settings and call numbers.
            fork = dataclasses.replace(
                draft_view, session_id=plan.session_id, synced=synced, opened=True, last_epoch=0, lost=False
            )
        return Settled(taken, fork, synced)

    def drop(self, call: BranchCall, unused: list[str] | None = None) -> None:
        """Cancels the branches' call; its forks (the pre-draft's session is the request's) join
        `unused`, or without one (the request is over: it ends its `unused` itself) end now, as no output."""
        call.cancel()
        forks = [plan.session_id for plan in call.forks]
        if unused is not None:
            unused.extend(forks)
        else:
            for session_id in forks:
                self.upstream.end_later(call.replica.client, session_id, discard=True, epoch=call.epoch)

    def end_now(self, session_ids: list[str], draft_view: SessionView) -> None:
        """Ends draft sessions on the request's draft replica by EndSession calls (in the
        background) and empties the list: forks no branch call will carry."""
        if draft_view.replica is not None:
            client = draft_view.replica.client
            for session_id in session_ids:
                self.upstream.end_later(client, session_id, discard=True, epoch=next(draft_view.calls))
        session_ids.clear()


def chosen_branch(
    call: BranchCall, hit: BranchPlan, branches: list[Round], errors: list[int], bonus_token_id: int
) -> BranchPlan | None:
    """The branch whose drafts the next round takes: for a hedge `pick` chose, that hedge if
    it answered; after a fully accepted round, the first branch by rank whose guess (its
    first token) is the bonus token."""
    if not hit.guesses:
        return hit if not errors[call.branches.index(hit)] else None
    guessed = zip(call.branches, branches, errors)
    return next((p for p, b, e in guessed if p.guesses and not e and right_guess(b, bonus_token_id)), None)


def right_guess(branch: Round, bonus_token_id: int) -> bool:
    """Whether a branch continuing a fully accepted round guessed its bonus token, with drafts
    past the guess (a branch that stopped at its guess, a confidence stop, carries none)."""
    return len(branch.draft_token_ids) > 1 and branch.draft_token_ids[0] == bonus_token_id
