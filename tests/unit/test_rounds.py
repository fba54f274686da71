"""The round loop's two pure phases, table-driven and without services: what `plan_round`
decides from a request's state, and what `commit_round` makes of a verified outcome."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from coordinator.adaptive import AdaptiveK
from coordinator.commit import RoundResult, commit_round
from coordinator.config import MAX_TARGET_ONLY_STEPS
from coordinator.hedging import Acceptance
from coordinator.metrics import GenerationStats
from coordinator.overlap import Overlap
from coordinator.pair import PairInfo
from coordinator.requests import Job
from coordinator.round_costs import BatchCosts, RoundCosts
from coordinator.rounds import (
    COPY_WAIT_ROUNDS,
    STEP_CALL_MS,
    RequestState,
    RoundKind,
    RoundPlan,
    draw_round,
    k_limit,
    plan_round,
    steps_per_call,
)
from coordinator.state import DraftRefusals, RetryWindow, Round, SessionView, Settled, Source
from coordinator.text import TextAssembler
from coordinator.upstream import Upstream
from specdec.rpc import wire
from specdec.sampling.chain import RoundOutcome
from specdec.sampling.probs import SamplingParams
from specdec.sampling.seeds import RequestStreams
from specdec.sampling.tree_sampling import TreeOutcome, tree_size
from specdec.tools.testing import byte_level_tokenizer
from specdec.v1 import target_pb2

PAIR = PairInfo(
    vocab_size=320,
    draft_vocab_size=320,
    eos_token_ids=frozenset({0}),
    max_context=64,
    draft_max_context=64,
    max_num_speculative_tokens=8,
    max_copied_tokens=16,
)
TOKENIZER = byte_level_tokenizer()
PROMPT = [65, 66, 67]


def state(k: int = 4, max_new_tokens: int = 32, pipelined: bool = False, **changes) -> RequestState:
    job = Job(PROMPT, max_new_tokens, SamplingParams(temperature=1.0), 7, (), k, tree_widths=changes.pop("tree", ()))
    made = RequestState(
        job=job,
        pair=PAIR,
        stats=GenerationStats(prompt_tokens=len(PROMPT)),
        streams=RequestStreams.of(job.seed),
        sampling=wire.params_to_pb(job.params),
        sequence=list(PROMPT),
        text=TextAssembler(TOKENIZER, PROMPT, set(PAIR.eos_token_ids), (), max_new_tokens),
        draft_view=SessionView("s"),
        target_view=SessionView("s"),
        overlap=Overlap(pipelined=pipelined),
        retry=RetryWindow(0.0),
    )
    return dataclasses.replace(made, **changes)


def verified(round_: Round, outcome, steps=()) -> RoundResult:
    """A round's result as the engine hands it to commit_round."""
    return RoundResult(round_, target_pb2.VerifyResponse(step_token_ids=list(steps)), outcome)


def refused_just_now() -> DraftRefusals:
    refusals = DraftRefusals()
    refusals.refused(0)
    return refusals


READY = Round(Source.PREDRAFT, [5, 6, 7], [0.5, 0.5, 0.5], [None] * 3, [], [])
# A draft step a tenth of a target pass (an accelerator) and one nearly as slow (these CPUs).
CHEAP_DRAFT = dataclasses.replace(
    PAIR, costs=RoundCosts(draft_pass_ms=(2.0,) * 9, target_pass_ms=(20.0,) * 9, draft_rpc_ms=1, target_rpc_ms=1)
)
DEAR_DRAFT = dataclasses.replace(
    PAIR, costs=RoundCosts(draft_pass_ms=(15.0,) * 9, target_pass_ms=(20.0,) * 9, draft_rpc_ms=1, target_rpc_ms=1)
)
OPENED = SessionView("s", synced=3, opened=True)  # a round after the first
VERIFIED = Acceptance(accepted=3, reached=4)  # drafts of the request's own were verified

# (case, state, pair, RoundRules.catch_up, breaker allows) -> (kind, K, copy cap, tree widths)
PLANS = {
    "a chain of K": (state(), PAIR, True, True, (RoundKind.DRAFT_CALL, 4, 0, ())),
    "K = 0 is one target-only step": (state(k=0), PAIR, True, True, (RoundKind.TARGET_ONLY, 0, 0, ())),
    "an open breaker falls back": (state(), PAIR, True, False, (RoundKind.FALLBACK, 0, 0, ())),
    "a refusal backs off": (state(refusals=refused_just_now()), PAIR, True, True, (RoundKind.FALLBACK, 0, 0, ())),
    "ready drafts, cut to K": (state(k=2, ready=READY), PAIR, True, True, (RoundKind.READY, 2, 0, ())),
    "ready drafts, K = 0: unused": (state(k=0, ready=READY), PAIR, True, True, (RoundKind.TARGET_ONLY, 0, 0, ())),
    "pipelined, none ready: a catch-up step": (state(pipelined=True), PAIR, True, True, (RoundKind.CATCH_UP, 4, 0, ())),
    "pipelined, catch-up steps off": (state(pipelined=True), PAIR, False, True, (RoundKind.DRAFT_CALL, 4, 0, ())),
    "pipelined, a cheap draft: fresh drafts after a miss": (
        state(pipelined=True, draft_view=OPENED), CHEAP_DRAFT, True, True, (RoundKind.DRAFT_CALL, 4, 0, ()),
    ),
    "pipelined, a dear draft: a catch-up step after a miss": (
        state(pipelined=True, draft_view=OPENED, acceptance=VERIFIED),
        DEAR_DRAFT,
        True,
        True,
        (RoundKind.CATCH_UP, 4, 0, ()),
    ),
    # A sampled request's steps teach the chooser nothing: it verifies a draft first.
    "pipelined, a dear draft, no draft verified yet: fresh drafts": (
        state(pipelined=True, draft_view=OPENED), DEAR_DRAFT, True, True, (RoundKind.DRAFT_CALL, 4, 0, ()),
    ),
    "pipelined, a cheap draft: the first round is a catch-up step": (
        state(pipelined=True), CHEAP_DRAFT, True, True, (RoundKind.CATCH_UP, 4, 0, ()),
    ),
    "pipelined, the last branch call failed": (
        state(pipelined=True, branch_failed=True), PAIR, True, True, (RoundKind.DRAFT_CALL, 4, 0, ()),
    ),
    "pipelined, ready drafts": (state(pipelined=True, ready=READY), PAIR, True, True, (RoundKind.READY, 4, 0, ())),
    "a copying draft copies up to K": (
        state(k=3), dataclasses.replace(PAIR, draft_copies=True), True, True, (RoundKind.DRAFT_CALL, 3, 3, ()),
    ),
    "two tokens to go: one draft": (state(max_new_tokens=2), PAIR, True, True, (RoundKind.DRAFT_CALL, 1, 0, ())),
    "a tree": (state(k=0, tree=(2, 1)), dataclasses.replace(PAIR, trees=True), True, True,
               (RoundKind.DRAFT_CALL, 0, 0, (2, 1))),
    "a tree, the draft no longer serves trees": (state(k=0, tree=(2, 1)), PAIR, True, True,
                                                 (RoundKind.TARGET_ONLY, 0, 0, ())),
}  # fmt: skip


@pytest.mark.parametrize("case", PLANS)
def test_plan_round(case):
    request, pair, catch_up, draft_allowed, (kind, k, copy, widths) = PLANS[case]
    planned = dataclasses.replace(request, pair=pair)
    plan = plan_round(planned, catch_up, draft_allowed)
    assert (plan.kind, plan.k, plan.copy_limit, plan.widths) == (kind, k, copy, widths)
    assert plan_round(planned, catch_up, draft_allowed) == plan, "planning changes nothing"
    assert len(draw_round(planned.streams, plan).uniforms) == (tree_size(widths) or max(k, copy))
    assert (plan.ready is not None) == (kind is RoundKind.READY)
    if plan.ready is not None:
        assert plan.ready.source is Source.PREDRAFT
        assert plan.ready.draft_token_ids == READY.draft_token_ids[:k]


def test_a_pipelined_round_beside_other_sessions_on_its_target_runs_sequential():
    """A pipelined request whose chooser costs it beside others on its target neither starts
    with a catch-up step nor catches up after a miss (`RequestState.overlapping`; nor does it
    pre-draft, engine): it starts target-only and drafts afresh, as a sequential request under
    load does. Alone, it catches up (the pair has no costs: `catch_up_pays`). The chooser's
    costs: a cheap draft, passes batched for free."""
    cheap = CHEAP_DRAFT.costs
    batched = dataclasses.replace(
        cheap,
        draft_batch=BatchCosts(cheap.draft_pass_ms, max_batch=8),
        target_batch=BatchCosts(cheap.target_pass_ms, max_batch=8),
    )

    def pipelined(sessions: int, **changes) -> RequestState:
        chooser = AdaptiveK(k_max=8, pipelined=True, costs=batched.at_load(sessions, sessions), alpha_prior=0.9)
        return state(pipelined=True, k_chooser=chooser, load_aware=True, **changes)

    alone, shared = pipelined(1), pipelined(2)
    assert alone.overlapping and not shared.overlapping
    assert plan_round(alone, True, True).kind is RoundKind.CATCH_UP
    assert (plan_round(shared, True, True).kind, plan_round(shared, True, True).k) == (RoundKind.TARGET_ONLY, 0)
    after_a_miss = {"draft_view": OPENED, "round_index": 1}
    assert plan_round(pipelined(1, **after_a_miss), True, True).kind is RoundKind.CATCH_UP
    assert plan_round(pipelined(2, **after_a_miss), True, True).kind is RoundKind.DRAFT_CALL


def test_the_random_draws_do_not_depend_on_the_rounds_kind():
    """The same request at the same round draws the same seeds and coins whether its drafts are
    ready, come from a call, or the round is a catch-up step: the kind never shifts a stream."""
    requests = [state(), state(ready=READY), state(pipelined=True)]
    plans = [plan_round(request, True, True) for request in requests]
    assert [p.kind for p in plans] == [RoundKind.DRAFT_CALL, RoundKind.READY, RoundKind.CATCH_UP]
    drawn = [draw_round(request.streams, plan) for request, plan in zip(requests, plans)]
    draws = {(d.draft_seed, d.target_seed, d.predraft_seed, tuple(d.uniforms[:3])) for d in drawn}
    assert len(draws) == 1


def test_the_k_chooser_decides_k_and_the_context_caps_it():
    costs = RoundCosts(draft_pass_ms=(1.0,) * 9, target_pass_ms=(50.0,) * 9, draft_rpc_ms=0.1, target_rpc_ms=0.1)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.9)
    near_the_end = state(sequence=list(range(60)), k_chooser=chooser)
    plan = plan_round(near_the_end, True, True)
    assert plan.chosen_k and plan.k == min(plan.chosen_k, k_limit(PAIR, 60, near_the_end.remaining)) == 3
    assert not chooser.history, "the plan changes nothing; commit_round counts the choice"
    commit_round(near_the_end, plan, verified(chain_round(), RoundOutcome(0, 81)))
    assert chooser.history == [plan.chosen_k]


def chain_round(source: Source = Source.DRAFT, tokens=(70, 71, 72), copied: bool = False) -> Round:
    return Round(source, list(tokens), [0.5] * len(tokens), [None] * len(tokens), [], [], copied)


# (case, round, outcome) -> (committed tokens, views' synced: (draft, target), counters)
COMMITS = {
    "all accepted, bonus": (chain_round(), RoundOutcome(3, 80), ([70, 71, 72, 80], (6, 6), {"bonus_tokens": 1})),
    "rejected at 1": (chain_round(), RoundOutcome(1, 81), ([70, 81], (4, 4), {"recovered_tokens": 1})),
    "a catch-up step leaves the draft session behind": (
        Round(Source.CATCH_UP), RoundOutcome(0, 82), ([82], (0, 3), {"catch_up_rounds": 1}),
    ),
    "a fallback round is counted once": (
        Round(Source.FALLBACK), RoundOutcome(0, 82), ([82], (0, 3), {"fallback_rounds": 1}),
    ),
    "a pre-draft's round is a ready round": (
        chain_round(Source.PREDRAFT), RoundOutcome(2, 90), ([70, 71, 90], (5, 5), {"ready_rounds": 1}),
    ),
    "a copy counts as one": (
        chain_round(copied=True), RoundOutcome(2, 90),
        ([70, 71, 90], (5, 5), {"copied_rounds": 1, "copied_accepted": 2}),
    ),
    "EOS ends the round": (chain_round(tokens=(70, 0, 72)), RoundOutcome(3, 80), ([70, 0], (6, 6), {})),
    "a tree keeps its nodes cached behind the sequence": (
        Round(Source.DRAFT, [70, 71, 72], [0.5] * 3, [None] * 3, [], [], parents=[0, 0, 1]),
        TreeOutcome(path=[1, 3], next_token_id=88, at_leaf=True),
        ([70, 72, 88], (3, 3), {"tree_rounds": 1, "bonus_tokens": 1}),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", COMMITS)
def test_commit_round(case):
    round_, outcome, (committed, synced, counters) = COMMITS[case]
    request = state(ready=READY, draft_view=SessionView("s", opened=True))  # a session its replica holds
    plan = plan_round(request, True, True)
    record = commit_round(request, plan, verified(round_, outcome))
    request.stats.observe(record)
    assert request.sequence == PROMPT + committed
    assert (request.draft_view.synced, request.target_view.synced) == synced
    assert request.ready is None, "ready drafts are spent by the round that planned them"
    for name, value in counters.items():
        assert getattr(request.stats, name) == value, name
    assert request.stats.rounds == request.round_index == 1
    assert request.stats.k_per_round == [len(round_.draft_token_ids)]
    assert request.finished == record.finished == (0 in committed)


def test_commit_round_leaves_a_moved_draft_session_unsynced():
    """A draft session moved to another replica since its pre-draft (not opened there) holds
    none of the round's tokens: the next call sends it the whole sequence."""
    round_, outcome, _ = COMMITS["a pre-draft's round is a ready round"]
    request = state(ready=READY, draft_view=SessionView("s", opened=False))
    commit_round(request, plan_round(request, True, True), verified(round_, outcome))
    assert request.draft_view.synced == 0 and request.target_view.synced > 0


def test_commit_round_finishes_at_the_context_and_at_max_new_tokens():
    at_context = state(sequence=list(range(60)))
    commit_round(at_context, plan_round(at_context, True, True), verified(chain_round(), RoundOutcome(3, 80)))
    assert at_context.text.finish_reason == "length" and len(at_context.sequence) == 64
    short = state(max_new_tokens=2)
    commit_round(short, plan_round(short, True, True), verified(chain_round(), RoundOutcome(3, 80)))
    assert short.text.finish_reason == "length" and short.sequence == PROMPT + [70, 71]


def test_commit_round_teaches_copies_to_the_copy_chooser_and_drafts_to_the_k_chooser():
    costs = RoundCosts(draft_pass_ms=(1.0,) * 9, target_pass_ms=(50.0,) * 9, draft_rpc_ms=0.1, target_rpc_ms=0.1)
    k_chooser, copy_chooser = (AdaptiveK(k_max=8, pipelined=False, costs=costs) for _ in range(2))
    request = state(k_chooser=k_chooser, copy_chooser=copy_chooser)
    before = (k_chooser.reached, copy_chooser.reached)
    plan = plan_round(request, True, True)
    commit_round(request, plan, verified(chain_round(copied=True), RoundOutcome(3, 80)))
    assert (k_chooser.reached, copy_chooser.reached) == (before[0], before[1] + 3)
    commit_round(request, plan, verified(chain_round(), RoundOutcome(1, 81)))
    assert k_chooser.reached == before[0] + 2


@pytest.mark.parametrize("greedy", [True, False])
def test_a_greedy_catch_ups_guess_is_one_draft_for_the_k_chooser(greedy):
    """A catch-up proposes nothing: its pre-draft's own guess of the step's token is the only
    draft it evaluates, and the chooser counts it (Settled.guessed; None: not a catch-up). Not
    a sampled request's: its guess, the draft's likeliest token, is the target's draw with
    p(guess), not with α."""
    costs = RoundCosts(draft_pass_ms=(1.0,) * 9, target_pass_ms=(50.0,) * 9, draft_rpc_ms=0.1, target_rpc_ms=0.1)
    chooser = AdaptiveK(k_max=8, pipelined=True, costs=costs)
    request = state(pipelined=True, k_chooser=chooser, draft_view=OPENED, acceptance=VERIFIED)
    if greedy:
        request.job = dataclasses.replace(request.job, params=SamplingParams())
    plan = plan_round(request, True, True)
    assert plan.kind is RoundKind.CATCH_UP
    before = (chooser.accepted, chooser.reached)
    for guessed in (False, True, None):  # missed, right, and no guess to learn from
        commit_round(request, plan, verified(Round(Source.CATCH_UP), RoundOutcome(0, 82)), Settled(guessed=guessed))
    learned = (chooser.accepted - before[0], chooser.reached - before[1])
    assert learned == pytest.approx((1, 2) if greedy else (0, 0))


def test_a_request_that_fixes_k_at_zero_steps_several_times_per_call_with_the_seeds_of_single_steps():
    """target_only_steps: a K = 0 request's Verify call carries the seeds of the steps after
    its first, drawn from the target's stream as that many single-step rounds would draw them,
    so the output does not depend on the setting; room is left for the last token."""

    def after_a_round(k: int = 0, **changes) -> RequestState:
        request = state(k=k, **changes)
        request.round_index = 1  # a request's first round steps once: its first token comes first
        return request

    assert plan_round(state(k=0), True, True, target_steps=4).steps == 0
    single = after_a_round()
    seeds = [draw_round(single.streams, plan_round(single, True, True)).target_seed for _ in range(4)]
    stepping = after_a_round()
    plan = plan_round(stepping, True, True, target_steps=4)
    draws = draw_round(stepping.streams, plan)
    assert plan.kind is RoundKind.TARGET_ONLY and [draws.target_seed, *draws.step_seeds] == seeds
    assert plan_round(after_a_round(max_new_tokens=2), True, True, target_steps=4).steps == 1
    assert plan_round(after_a_round(sequence=list(range(62))), True, True, target_steps=4).steps == 1
    costs = RoundCosts(draft_pass_ms=(40.0,) * 9, target_pass_ms=(1.0,) * 9)
    chosen = state(k=4, k_chooser=AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.1, probe_every=0))
    chosen.round_index = 1
    assert plan_round(chosen, True, True, target_steps=4).steps == 3, "a chosen K = 0 steps on, seeded or not"
    chosen.load_aware = True  # greedy or unseeded: its K follows the load
    assert plan_round(chosen, True, True, target_steps=4).steps == 3
    assert plan_round(after_a_round(k=4), True, True, target_steps=4).steps == 0


def test_a_k_zero_call_steps_more_where_the_targets_passes_are_short():
    """steps_per_call: at least target_only_steps, else as many as fill about STEP_CALL_MS of
    one-token passes, at most MAX_TARGET_ONLY_STEPS; without calibrated costs, the setting."""

    def costs(pass_ms: float) -> RoundCosts:
        return RoundCosts(draft_pass_ms=(1.0,) * 9, target_pass_ms=(pass_ms,) * 9)

    assert steps_per_call(4, None) == 4
    assert steps_per_call(4, costs(55.0)) == 4  # a CPU's 1.5B pass: the setting
    assert steps_per_call(4, costs(2.0)) == int(STEP_CALL_MS // 2.0)  # a captured GPU pass
    assert steps_per_call(4, costs(0.01)) == MAX_TARGET_ONLY_STEPS
    request = dataclasses.replace(state(k=0), pair=dataclasses.replace(PAIR, costs=costs(2.0)))
    request.round_index = 1
    plan = plan_round(request, True, True, target_steps=4)
    assert plan.steps == int(STEP_CALL_MS // 2.0) - 1
    single = state(k=0)
    single.round_index = 1
    seeds = [draw_round(single.streams, plan_round(single, True, True)).target_seed for _ in range(plan.steps + 1)]
    draws = draw_round(request.streams, plan)
    assert [draws.target_seed, *draws.step_seeds] == seeds  # the seeds of single steps: the same output


def test_a_target_only_calls_steps_are_committed_as_rounds_of_their_own():
    request = state(k=0)
    plan = plan_round(request, True, True, target_steps=3)
    request.stats.sessions_per_round.append(2)  # the load its K was costed at (Choosers.costs_at_load)
    request.stats.observe(commit_round(request, plan, verified(Round(Source.NONE), RoundOutcome(0, 80), [81, 82])))
    assert request.stats.sessions_per_round == [2, 2, 2], "each step ran at the load the call was costed at"
    assert request.sequence == PROMPT + [80, 81, 82]
    assert request.target_view.synced == len(PROMPT) + 2, "the target fed every token but the last"
    assert (request.stats.rounds, request.stats.k_per_round, request.stats.bonus_tokens) == (3, [0, 0, 0], 3)
    assert request.round_index == 3
    ending = state(k=0)
    commit_round(ending, plan, verified(Round(Source.NONE), RoundOutcome(0, 80), [0]))
    assert ending.sequence == PROMPT + [80, 0] and ending.finished


def test_a_lookup_that_found_nothing_is_not_repeated_for_a_few_target_only_rounds():
    """K = 0 and a copy alone would call the draft: after a call that copied nothing, the next
    COPY_WAIT_ROUNDS rounds are target-only (under load each carries several steps); a round
    that drafts with the model is not held back."""
    pair = dataclasses.replace(PAIR, draft_copies=True)
    dear = RoundCosts(draft_pass_ms=(40.0,) * 9, target_pass_ms=(1.0,) * 9)
    free = RoundCosts(draft_pass_ms=(0.0,) * 9, target_pass_ms=(1.0,) * 9)
    request = state(
        pair=pair,
        k_chooser=AdaptiveK(k_max=8, pipelined=False, costs=dear, alpha_prior=0.1, probe_every=0),
        copy_chooser=AdaptiveK(k_max=8, pipelined=False, costs=free, alpha_prior=0.9),
    )
    kinds = []
    for _ in range(2 * (COPY_WAIT_ROUNDS + 1)):
        plan = plan_round(request, True, True)
        kinds.append(plan.kind)
        nothing = Round(Source.DRAFT if plan.kind is RoundKind.DRAFT_CALL else Source.NONE)
        commit_round(request, plan, verified(nothing, RoundOutcome(0, 82)))
    looked_up = [RoundKind.DRAFT_CALL] + [RoundKind.TARGET_ONLY] * COPY_WAIT_ROUNDS
    assert kinds == looked_up * 2
    request.copy_wait = COPY_WAIT_ROUNDS
    request.k_chooser = AdaptiveK(k_max=8, pipelined=False, costs=free, alpha_prior=0.9)
    plan = plan_round(request, True, True)
    assert plan.kind is RoundKind.DRAFT_CALL and plan.k and plan.copy_limit, "the model drafts, copies ride along"


def test_a_chosen_copy_may_be_longer_than_the_largest_k_within_the_room_left():
    """A copy runs no draft pass, so the copy chooser may pick up to max_copied_tokens (16
    here, K at most 8), cut to the room the sequence and max_new_tokens leave; a request that
    fixes K copies at most K."""
    free = RoundCosts(draft_pass_ms=(0.0,) * 9, target_pass_ms=(1.0,) * 9)  # a verify costs the same at any size
    pair = dataclasses.replace(PAIR, draft_copies=True)

    def chosen(max_new_tokens: int, k=None) -> RoundPlan:
        request = state(k=4 if k is None else k, max_new_tokens=max_new_tokens, pair=pair)
        if k is None:
            request.k_chooser = AdaptiveK(k_max=8, pipelined=False, costs=free, alpha_prior=0.99)
            request.copy_chooser = AdaptiveK(k_max=16, pipelined=False, costs=free, alpha_prior=0.99)
        return plan_round(request, True, True)

    assert chosen(32).copy_limit == 16 and chosen(32).k == 8
    assert chosen(10).copy_limit == 9, "room for the copy and the bonus token"
    assert chosen(32, k=3).copy_limit == 3


def test_a_request_whose_k_follows_the_load_starts_with_a_target_only_step_that_copies_nothing():
    free = RoundCosts(draft_pass_ms=(0.0,) * 9, target_pass_ms=(1.0,) * 9)
    request = state(
        pair=dataclasses.replace(PAIR, draft_copies=True),
        k_chooser=AdaptiveK(k_max=8, pipelined=False, costs=free, alpha_prior=0.9),
        copy_chooser=AdaptiveK(k_max=8, pipelined=False, costs=free, alpha_prior=0.9),
        load_aware=True,
    )
    first = plan_round(request, True, True)
    assert (first.kind, first.k, first.copy_limit) == (RoundKind.TARGET_ONLY, 0, 0)
    request.round_index = 1
    assert plan_round(request, True, True).kind is RoundKind.DRAFT_CALL


def test_the_last_rounds_k_is_the_best_within_the_tokens_left():
    """Two tokens left, where one draft runs slower than a target-only step but the unbounded
    best is a long round (captured H200 passes, α 0.95): the round is target-only, not the
    best K cut to one draft."""
    from bench.chooser_sim import pair_costs

    costs = pair_costs("h200-captured-1.5b", "h200-captured-0.5b", 0.8)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.95)
    chooser.accepted, chooser.reached = 190.0, 200.0  # α settled at 0.95
    rates = costs.rates(chooser.alpha, 8, pipelined=False)
    assert max(range(9), key=rates.__getitem__) >= 2 and rates[1] < rates[0]
    two_left = state(max_new_tokens=2, k_chooser=chooser, pair=dataclasses.replace(PAIR, costs=costs))
    assert plan_round(two_left, True, True).k == 0
    assert plan_round(state(max_new_tokens=40, k_chooser=chooser, pair=PAIR), True, True).k >= 2


# A draft step a quarter of a target pass, its passes dearer by half a millisecond a token.
FAR_COSTS = RoundCosts(tuple(5.0 + 0.5 * n for n in range(9)), (20.0,) * 9, draft_rpc_ms=1, target_rpc_ms=1)
FAR_PAIR = dataclasses.replace(PAIR, max_context=8192, draft_max_context=8192, costs=FAR_COSTS)


def test_a_draft_far_behind_is_not_caught_up_where_the_tokens_left_cannot_repay_it():
    """A soak on the real pair: a 6,061-token prompt with max_tokens 32 took 95-103 s with the
    K chooser against 75 s target-only, since the draft prefilled the whole prompt (21-26 s)
    after the target's first token, for at most 31 tokens' saving. The round is target-only
    where running what the draft's model has not run costs more than K drafts can save over
    the tokens left; a draft that has run it, or a long answer, drafts as before."""
    costs, pair = FAR_COSTS, FAR_PAIR

    def request(max_new_tokens: int, draft_view: SessionView) -> RequestState:
        chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.9)
        return state(
            max_new_tokens=max_new_tokens,
            sequence=list(range(2000)),
            k_chooser=chooser,
            pair=pair,
            draft_view=draft_view,
        )

    behind = SessionView("s", synced=3, modeled=3, opened=True)  # the prompt went to the target alone
    assert plan_round(request(32, behind), True, True).k == 0  # about 1 s of prefill against 0.3 s saved
    assert plan_round(request(500, behind), True, True).k >= 2  # against 5 s saved
    caught_up = SessionView("s", synced=2000, modeled=2000, opened=True)
    assert plan_round(request(32, caught_up), True, True).k >= 2
    # Copies carried the draft's sequence along, but its model has run none of it.
    copied_along = request(32, SessionView("s", synced=2000, modeled=3, opened=True))
    assert plan_round(copied_along, True, True).k == 0
    plan = dataclasses.replace(plan_round(copied_along, True, True), k=1)
    commit_round(copied_along, plan, verified(chain_round(copied=True, tokens=(70,)), RoundOutcome(1, 80)))
    assert copied_along.draft_view.modeled == 3 and plan_round(copied_along, True, True).k == 0
    commit_round(copied_along, plan, verified(chain_round(tokens=(71,)), RoundOutcome(1, 81)))
    assert copied_along.draft_view.modeled == 2003 and plan_round(copied_along, True, True).k >= 2


def test_a_probe_of_a_draft_far_behind_still_runs_and_a_moved_session_is_behind_again():
    """A review: the rule above also held back probes and hunches (K not thought to pay at the
    estimated α: the chooser's only way to learn that α rose), so a request at K = 0 never
    drafted again. And a session moved to another replica kept its `modeled` mark, so copies
    re-syncing it there hid that the new replica's model had run nothing."""
    costs, pair = FAR_COSTS, FAR_PAIR
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.1)
    chooser.zero_streak = 50  # a probe is due
    assert best_k_at(chooser) == 0
    behind = SessionView("s", synced=3, modeled=3, opened=True)
    probing = state(max_new_tokens=32, sequence=list(range(2000)), k_chooser=chooser, pair=pair, draft_view=behind)
    assert plan_round(probing, True, True).k > 0

    class OnePool:  # a pool that places the session on another replica
        def place(self, **_):
            return "another replica"

    view = SessionView("s", synced=2000, modeled=2000, opened=True)
    assert Upstream.move(cast(Any, None), cast(Any, OnePool()), view)  # from no replica: nothing to end
    view.synced = 2000  # copies re-sent the sequence there; the new replica's model ran none of it
    moved = state(max_new_tokens=32, sequence=list(range(2000)), k_chooser=AdaptiveK(8, False, costs, 0.9), pair=pair)
    moved.draft_view = view
    assert view.modeled == 0 and plan_round(moved, True, True).k == 0


def test_a_first_round_that_pays_by_a_hair_at_the_prior_still_drafts():
    """`make run` on a 2-core Intel machine (2026-12-07), three runs in seven: a prior of 0.627
    (a warm-up request had accepted its one draft) priced the first K = 1 at 0.86 ms saved a
    token, 82 ms over the 95 tokens left, under the 99 ms the draft's model takes to read the
    34-token prompt, so every round was target-only, none taught α, and the code prompt ran
    0.97× where K = 3 ran 1.19×. At the α the chooser holds plausible the prefill repays."""
    costs = RoundCosts(
        (37.8, 42.2, 45.3, 48.5, 51.7, 54.9, 56.0, 57.5, 61.2),
        (79.0, 89.0, 99.0, 103.0, 110.0, 118.0, 125.0, 129.0, 139.0),
        draft_rpc_ms=0.84,
        target_rpc_ms=0.81,
    )
    pair = dataclasses.replace(PAIR, max_context=8192, draft_max_context=8192, costs=costs)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.627)
    assert best_k_at(chooser) == 1 and chooser.gain(1, chooser.alpha) > 1.0  # pays at the estimate
    first = state(max_new_tokens=95, sequence=list(range(34)), k_chooser=chooser, pair=pair)
    assert plan_round(first, True, True).k == 1


def best_k_at(chooser: AdaptiveK) -> int:
    from coordinator.adaptive import best_k

    return best_k(chooser.alpha, chooser.costs, chooser.k_max, chooser.pipelined)
