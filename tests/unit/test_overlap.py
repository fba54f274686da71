"""The overlap chosen per request (coordinator.overlap): pipelining, hedges and bonus guesses
from the cost model where the flags leave them to it, the plain rounds where nothing overlaps."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.adaptive import DEFAULT_RESCUE_PRIOR
from coordinator.overlap import (
    RUNNER_UP_SHARES,
    Overlap,
    RowCost,
    best_rate,
    choose_overlap,
    rescue_share,
    row_cost_sample,
)
from coordinator.round_costs import BatchCosts, RoundCosts

KS = tuple(range(1, 9))
AUTO = (None, None, None)


def flat(draft_ms: float, target_ms: float, rows_cost: bool = False, **changes) -> RoundCosts:
    """An accelerator-like pair: passes flat in their tokens, a batch of rows costing one pass;
    or (`rows_cost`) a CPU-like draft whose batched rows cost a pass each."""
    draft = (draft_ms,) * 16
    measured = tuple((b, 1, draft_ms * (b if rows_cost else 1)) for b in (2, 4, 8, 16))
    return RoundCosts(draft, (target_ms,) * 16, 0.5, 0.5, draft_batch=BatchCosts(draft, measured, 16), **changes)


def test_target_only_and_uncosted_requests_run_plain_rounds():
    assert choose_overlap(flat(2.0, 20.0), 0.8, (0,), *AUTO) == Overlap()
    # Hedges auto chose ride only in rounds that pre-draft (the engine reads `chosen`).
    assert choose_overlap(flat(1.0, 20.0), 0.8, KS, *AUTO).chosen
    assert not choose_overlap(flat(1.0, 20.0), 0.8, KS, True, 2, None).chosen
    assert choose_overlap(None, 0.8, KS, *AUTO) == Overlap()
    # A flag holds without costs too.
    assert choose_overlap(None, 0.8, KS, True, 2, 1) == Overlap(True, 2, 1)
    assert choose_overlap(None, 0.8, KS, True, None, None) == Overlap(True, 0, 1)


def test_a_cheap_batched_draft_pipelines_with_hedges_and_guesses():
    chosen = choose_overlap(flat(1.0, 20.0), 0.8, KS, *AUTO)
    assert chosen.pipelined and chosen.hedges > 0
    assert 0 < chosen.rescue <= sum(RUNNER_UP_SHARES)
    sequential = best_rate(flat(1.0, 20.0), Overlap(), 0.8, KS)[1]
    assert best_rate(flat(1.0, 20.0), chosen, 0.8, KS)[1] > 1.1 * sequential


def test_shared_cores_never_overlap_unasked():
    shared = flat(1.0, 20.0, shared_host=True)
    assert choose_overlap(shared, 0.8, KS, *AUTO) == Overlap()
    # Asked to pipeline, it does, and chooses no hedges of its own there.
    assert choose_overlap(shared, 0.8, KS, True, None, None) == Overlap(True, 0, 1)


def test_rows_that_cost_a_pass_each_are_not_hedged():
    """A CPU draft steps several rows at nearly the cost of as many passes: hedges would delay
    the pre-draft past its verify."""
    dear_rows = flat(4.0, 20.0, rows_cost=True)
    chosen = choose_overlap(dear_rows, 0.8, KS, *AUTO)
    assert chosen.pipelined and chosen.hedges == 0 and chosen.bonus_guesses == 1


def test_a_draft_nearly_as_dear_as_the_target_runs_sequential_rounds():
    """Where a pre-draft of K + 1 steps outlasts the verify, whatever it drafts, and a miss then
    costs a fresh draft on top, sequential rounds win."""
    dear = RoundCosts((18.0,) * 16, (20.0,) * 16, 0.5, 0.5)
    assert not choose_overlap(dear, 0.6, KS, *AUTO).pipelined


def test_flags_fix_their_part_and_leave_the_rest():
    costs = flat(1.0, 20.0)
    assert choose_overlap(costs, 0.8, KS, False, None, None) == Overlap()  # no hedges without pipelining
    fixed = choose_overlap(costs, 0.8, KS, True, 2, 3)
    assert fixed == Overlap(True, 2, 3) and fixed.rescue == DEFAULT_RESCUE_PRIOR  # a hand-set count: neutral prior
    assert choose_overlap(costs, 0.8, KS, None, 0, 1) == Overlap(True, 0, 1)
    assert choose_overlap(costs, 0.8, KS, True, 0, None).hedges == 0


def test_a_fixed_k_is_costed_at_that_k():
    # One draft a round leaves little to hedge; eight leave more.
    one = choose_overlap(flat(1.0, 20.0), 0.8, (1,), *AUTO)
    eight = choose_overlap(flat(1.0, 20.0), 0.8, (8,), *AUTO)
    assert one.hedges <= eight.hedges


def test_rescue_share_grows_with_hedges_to_the_runner_ups_whole_share():
    shares = [rescue_share(0.8, 4, hedges) for hedges in (0, 1, 2, 4, 8, 16)]
    assert shares[0] == 0.0 and shares == sorted(shares)
    assert shares[-1] == pytest.approx(sum(RUNNER_UP_SHARES))
    # The first hedge assumes the first position's first runner-up, the likeliest outcome.
    assert shares[1] == pytest.approx(RUNNER_UP_SHARES[0] / sum(0.8**j for j in range(4)))


def test_the_branch_calls_rows_and_guesses_are_costed():
    costs = flat(2.0, 20.0, rows_cost=True)
    wide = Overlap(True, 3, 2).costs(costs)
    assert wide.branch_rows == 5 and wide.guess_share == RUNNER_UP_SHARES[0]
    assert wide.predraft_ms(5) == pytest.approx(0.5 + 5 * 5 * 2.0)  # five rows at a pass each, five steps
    assert Overlap(True, 3, 2).costs(costs, guesses=False).guess_share == 0.0  # the K chooser's
    # Rows past the draft's batch size are priced as further passes (their forks' own work).
    one_at_a_time = RoundCosts((2.0,) * 16, (20.0,) * 16, 0.5, 0.5, draft_batch=BatchCosts((2.0,) * 16, (), 1))
    assert Overlap(True, 3, 2).costs(one_at_a_time).predraft_ms(5) == pytest.approx(0.5 + 5 * 5 * 2.0)
    assert Overlap(True).costs(costs).predraft_ms(5) == pytest.approx(costs.draft_ms(5))
    # A second guess makes a pipelined round's pre-draft likelier kept.
    plain = Overlap(True).costs(flat(2.0, 20.0))
    guessed = Overlap(True, 0, 2).costs(flat(2.0, 20.0))
    assert guessed.round_ms(4, 0.7, pipelined=True) < plain.round_ms(4, 0.7, pipelined=True)


def test_a_rows_learned_cost_is_priced_per_row_and_step():
    costs = dataclasses.replace(Overlap(True, 4).costs(flat(2.0, 20.0)), branch_row_ms=0.1)
    assert costs.predraft_ms(6) == pytest.approx(0.5 + 6 * (2.0 + 5 * 0.1))  # five rows, six steps
    # The pre-draft alone is a draft call: its row cost is the calibrated step's.
    alone = dataclasses.replace(Overlap(True).costs(flat(2.0, 20.0)), branch_row_ms=0.1)
    assert alone.predraft_ms(6) == pytest.approx(alone.draft_ms(6))


def test_the_row_cost_is_learned_from_what_calls_took_beyond_their_costs():
    costs = flat(2.0, 20.0)
    # 5 rows, 6 steps: costed 0.5 + 6 x 2.0 = 12.5 ms; it took 15.5, 0.1 ms a row a step more.
    assert row_cost_sample(costs, 5, 6, 15.5) == pytest.approx(0.1)
    # Costed at the load it ran beside (the draft's batch of 16 full: two passes a step), the
    # same call took less than its costs.
    assert row_cost_sample(costs.at_load(1, 16), 5, 6, 15.5) < 0
    learned = RowCost()
    learned.observe(0.1)
    learned.observe(0.2)  # the mean of the first ten
    assert learned.ms == pytest.approx(0.15)
    learned.observe(-0.15)  # quicker than costed: a sample like any other, so noise averages out
    assert learned.ms == pytest.approx(0.05)
    for _ in range(100):  # past its first ten calls, a running mean weighted ROW_COST_WEIGHT
        learned.observe(0.3)
    assert learned.ms == pytest.approx(0.3, abs=1e-4)
    assert learned.priced(costs).branch_row_ms == 0.3 and learned.priced(costs).draft_pass_ms == costs.draft_pass_ms
    assert RowCost(ms=-0.2).priced(costs).branch_row_ms == 0.0  # never priced below the pass


def test_a_learned_row_cost_takes_the_hedges_that_outlast_the_verify_away():
    """The emulated 70B / 1B H100 pair as its coordinator costed it (a draft step of 1.9 ms, its
    batched rows calibrated flat at 2.0 ms, the draft's batch size 8; a target pass of 18.5 ms):
    unpriced, the rows of 12 hedges look free and auto chose them at α 0.6-0.77; at the 0.08
    ms a row a step its calls took beyond that, four."""
    draft = (1.9,) * 9
    batch = BatchCosts(draft, ((2, 1, 2.0), (2, 9, 2.0), (4, 1, 2.0), (4, 9, 2.1), (8, 1, 2.0), (8, 9, 2.3)), 8)
    costs = RoundCosts(draft, (18.5,) * 9, 0.78, 0.8, draft_batch=batch)
    assert choose_overlap(costs, 0.7, KS, *AUTO).hedges == 8
    assert choose_overlap(dataclasses.replace(costs, branch_row_ms=0.08), 0.7, KS, *AUTO).hedges == 4
