"""Hedged pre-drafts: which outcomes are hedged, and forks of a draft session that explore
them without disturbing it."""

from __future__ import annotations

import pytest
import torch

from coordinator.config import parse_config
from coordinator.hedging import Acceptance, PredraftDepth, plan_hedges, runner_ups_for
from coordinator.state import round_from
from draft_service.drafter import ProposeCall
from draft_service.runner import DraftRunner
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument, SessionNotFound, SpecDecError, StaleRequest
from specdec.sampling.probs import SamplingParams
from specdec.v1 import common_pb2, draft_pb2

GREEDY = SamplingParams()


def test_hedges_rank_outcomes_by_reach_rejection_and_runner_up_probability():
    # alpha 0.5: position j is reached with 0.5^j, so a likely runner-up late can lose to a
    # less likely one early.
    plan = plan_hedges([[10], [11], [12]], [[0.2], [0.9], [0.3]], alpha=0.5, limit=3)
    assert [(h.position, h.recovered_token_id) for h in plan] == [(1, 11), (0, 10), (2, 12)]
    assert plan[0].score == pytest.approx(0.5 * 0.5 * 0.9)
    assert [h.position for h in plan_hedges([[10], [11], [12]], [[0.2], [0.9], [0.3]], alpha=0.5, limit=1)] == [1]


def test_hedges_fan_out_over_several_runner_ups_per_position():
    # alpha 0.8: position 1 is reached with 0.8, so position 0's second runner-up (0.3)
    # outranks position 1's first (0.8 · 0.35 = 0.28), and its third (0.1) ranks last.
    ids, probs = [[10, 20, 30], [11, 21, 31]], [[0.5, 0.3, 0.1], [0.35, 0.2, 0.05]]
    plan = plan_hedges(ids, probs, alpha=0.8, limit=4)
    assert [(h.position, h.recovered_token_id) for h in plan] == [(0, 10), (0, 20), (1, 11), (1, 21)]
    assert len(plan_hedges(ids, probs, alpha=0.8, limit=24)) == 6


def test_runner_ups_asked_for_follow_the_hedges():
    assert [runner_ups_for(hedges) for hedges in (0, 1, 2, 3, 8, 24)] == [0, 0, 2, 3, 4, 4]


def test_a_reply_s_runner_ups_come_per_position_and_a_ragged_list_is_refused():
    one_hot = common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())

    def reply(ids: list[int], probs: list[float]) -> draft_pb2.ProposeResponse:
        return draft_pb2.ProposeResponse(
            token_ids=[2, 0], distributions=[one_hot, one_hot], runner_up_token_ids=ids, runner_up_probs=probs
        )

    fanned = round_from(reply([1, 3, 4, 5], [0.5, 0.25, 0.75, 0.5]), 2, "d:1", 8)  # exact in float32
    assert (fanned.runner_up_ids, fanned.runner_up_probs) == ([[1, 3], [4, 5]], [[0.5, 0.25], [0.75, 0.5]])
    assert fanned.truncated(1, start=1).runner_up_ids == [[4, 5]]
    assert round_from(reply([1, 4], [0.5, 0.25]), 2, "d:1", 8).runner_up_ids == [[1], [4]]  # one each: older drafts
    assert round_from(reply([], []), 2, "d:1", 8).runner_up_ids == []
    for ids, probs in (([1, 3, 4], [0.1] * 3), ([1, 3], [0.1]), ([1] * 10, [0.1] * 10)):
        with pytest.raises(SpecDecError, match="runner_up_token_ids .* malformed"):
            round_from(reply(ids, probs), 2, "d:1", 8)


def test_hedges_skip_end_of_sequence_and_impossible_tokens():
    plan = plan_hedges([[7], [8], [9]], [[0.5], [0.0], [0.4]], alpha=0.8, limit=8, skip_token_ids={7})
    assert [(h.position, h.recovered_token_id) for h in plan] == [(2, 9)]
    assert plan_hedges([], [], alpha=0.8, limit=2) == []


def test_acceptance_starts_at_the_prior_and_counts_positions_reached():
    acceptance = Acceptance()
    assert acceptance.alpha == pytest.approx(0.75)
    acceptance.observe(6, 6)  # every position reached and accepted
    acceptance.observe(6, 2)  # positions 1-3 reached, the third rejected
    acceptance.observe(0, 0)  # a target-only round reaches none
    assert (acceptance.accepted, acceptance.reached) == (8, 9)
    assert acceptance.alpha == pytest.approx((8 + 1.5) / 11)


def test_pre_drafts_drop_their_last_step_while_it_comes_back_after_the_verify():
    depth = PredraftDepth()
    assert depth.steps(6) == 7  # nothing seen: the bonus guess and K drafts
    depth.observe(-3.0, step_ms=1.9, full=True)  # that call, of seven steps, replied 3 ms after its verify
    assert depth.steps(6) == 6 and depth.steps(1) == 2  # one draft is never cut to none
    # Six steps now reply 1 ms early, so seven would still be 0.9 ms late: stay at six.
    for _ in range(10):
        depth.observe(1.0, step_ms=1.9, full=False)
        assert depth.steps(6) == 6
    # Once six steps reply 2.5 ms early, the seventh fits again.
    for _ in range(10):
        depth.observe(2.5, step_ms=1.9, full=False)
    assert depth.steps(6) == 7
    assert depth.slack_ms is not None and 0 < depth.slack_ms < 2.5


def test_hedges_flag_is_bounded():
    base = ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t"]
    assert parse_config(base, env={}).hedges is None  # auto: chosen with the pipelining
    assert parse_config([*base, "--hedges", "3"], env={}).hedges == 3
    assert parse_config([*base, "--hedges", "0"], env={}).hedges == 0
    assert parse_config([*base, "--pipeline", "auto", "--bonus-guesses", "auto"], env={}).pipeline is None
    with pytest.raises(SystemExit):
        parse_config([*base, "--hedges", "25"], env={})


@pytest.fixture(scope="module")
def draft_runner(tiny_pair) -> DraftRunner:
    return DraftRunner(
        load_causal_lm(str(tiny_pair.draft), "float32", "cpu"),
        max_sessions=8,
        session_ttl_s=60,
        max_speculative_tokens=8,
        proposal_top_k=0,
    )


def test_a_fork_drafts_as_a_fresh_session_would_and_leaves_its_parent_alone(draft_runner):
    prompt = list(range(5, 25))
    parent = draft_runner.propose_one(ProposeCall("parent", 0, prompt, 4, GREEDY, 0, epoch=1))
    parent_tokens = list(draft_runner.sessions.open("parent", 1).tokens)
    # "Draft 2 rejected, token 77 recovered": keep the prompt and the first two drafts.
    keep = len(prompt) + 2
    branch = draft_runner.propose_one(ProposeCall("branch", keep, [77], 3, GREEDY, 0, epoch=2, fork_from="parent"))
    assert branch.processed_tokens == 3, "only 77 and then one draft per step may run: the prefix is the parent's cache"
    fresh = draft_runner.propose_one(ProposeCall("fresh", 0, [*prompt, *parent.token_ids[:2], 77], 3, GREEDY, 0))
    assert branch.token_ids == fresh.token_ids
    torch.testing.assert_close(branch.probs, fresh.probs)
    assert draft_runner.sessions.open("parent", 1).tokens == parent_tokens
    # The parent goes on from where it was.
    later = draft_runner.propose_one(ProposeCall("parent", len(parent_tokens), [], 1, GREEDY, 0, epoch=3))
    assert later.sequence_length == len(parent_tokens) + 1
    for session_id in ("parent", "branch", "fresh"):
        draft_runner.end_session(session_id)


def test_stale_unknown_or_clashing_forks_open_nothing(draft_runner):
    draft_runner.propose_one(ProposeCall("p", 0, [5, 6, 7, 8], 2, GREEDY, 0, epoch=5))
    before = len(draft_runner.sessions)
    with pytest.raises(StaleRequest, match="superseded"):
        draft_runner.propose_one(ProposeCall("b", 3, [9], 2, GREEDY, 0, epoch=4, fork_from="p"))
    with pytest.raises(SessionNotFound):
        draft_runner.propose_one(ProposeCall("b", 3, [9], 2, GREEDY, 0, epoch=6, fork_from="gone"))
    with pytest.raises(InvalidArgument, match="already exists"):
        draft_runner.propose_one(ProposeCall("p", 3, [9], 2, GREEDY, 0, epoch=6, fork_from="p"))
    with pytest.raises(InvalidArgument, match="a fork keeps"):
        draft_runner.propose_one(ProposeCall("b", 99, [9], 2, GREEDY, 0, epoch=6, fork_from="p"))
    assert len(draft_runner.sessions) == before
    draft_runner.end_session("p")


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("runner_ups", [1, 3])
def test_runner_ups_are_the_likeliest_other_tokens(draft_runner, params, runner_ups):
    proposal = draft_runner.propose_one(ProposeCall("r", 0, [5, 6, 7, 8], 4, params, 1, runner_ups=runner_ups))
    assert len(proposal.runner_up_ids) == len(proposal.runner_up_probs) == runner_ups * len(proposal.token_ids)
    for position, token in enumerate(proposal.token_ids):
        ids = proposal.runner_up_ids[position * runner_ups : (position + 1) * runner_ups]
        probs = proposal.runner_up_probs[position * runner_ups : (position + 1) * runner_ups]
        assert token not in ids and len(set(ids)) == runner_ups
        assert probs == sorted(probs, reverse=True) and all(0.0 <= prob <= 1.0 for prob in probs)
        if not params.greedy:  # the rows sent are the beliefs ranked
            row = proposal.probs[position]
            assert probs == pytest.approx([float(row[other]) for other in ids])
            others = row.clone()
            others[token] = 0.0
            assert probs == pytest.approx(others.topk(runner_ups).values.tolist())
    draft_runner.end_session("r")


def test_a_guessed_first_token_is_the_argmax_and_the_rest_are_drawn_as_usual(draft_runner):
    """ProposeRequest.guess_first (a pre-draft's bonus guess): the first token is the draft's
    argmax, sent one-hot, even when the request samples; the tokens after it are drawn as a
    call that was sent the guess would draw them, with the same seed and distributions."""
    sampled, prompt = SamplingParams(temperature=1.0), [5, 6, 7, 8, 9]
    argmax = draft_runner.propose_one(ProposeCall("a", 0, prompt, 1, GREEDY, 0)).token_ids[0]
    guessed = draft_runner.propose_one(ProposeCall("g", 0, prompt, 4, sampled, 3, guess_first=True))
    assert guessed.token_ids[0] == argmax and not guessed.deterministic
    assert float(guessed.probs[0][argmax]) == 1.0 and float(guessed.probs[0].sum()) == 1.0
    assert [(row.ids.tolist(), row.values.tolist()) for row in guessed.supports[:1]] == [([argmax], [1.0])]
    after = draft_runner.propose_one(ProposeCall("f", 0, [*prompt, argmax], 3, sampled, 3))
    assert guessed.token_ids[1:] == after.token_ids
    torch.testing.assert_close(guessed.probs[1:], after.probs, atol=1e-5, rtol=1e-4)
    for session in ("a", "g", "f"):
        draft_runner.end_session(session)
