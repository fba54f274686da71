"""High-power distribution tests for each coordinator mode, each with a mutation check.

The real coordinator (coordinator.engine.Engine, built by coordinator.server.connect)
drives in-process draft and target services whose models are lookup tables
(tests/table_services.py): a few tokens, a few positions, so the target's distribution over
whole continuations is known exactly and tens of thousands of generations take a minute or
two of one core. Each mode is sampled and compared with that distribution by a χ² test.

Power. For any output distribution at total-variation distance δ from the target's, the χ²
noncentrality is n·Σ(Δ²/p) ≥ n·(Σ|Δ|)² = 4nδ² (Cauchy-Schwarz), whatever the shape of the
bias. Each mode draws the fewest samples (`samples_for_power`) that detect δ = 0.02 with
probability ≥ 0.9 at the p < 1e-4 bound: 30,000 over 16 outcomes (power 0.905), 40,000 over
27 (0.958). `test_power` checks this and draws a worst-case biased sample that must fail. The
over-the-wire χ² cases in test_distribution.py (3,000 samples, real models) stay as the
end-to-end proof that the real services draw what they send.

Mutation checks. Each mode's test must fail when only that mode's own path is made inexact
in a way a real bug could: a token emitted from the wrong position, drafts paired with the
wrong distributions, or drafts chosen, kept or dropped by looking at their own draws. A
mutant is sampled 3,000 or 10,000 times (the hedge picked by its drafts, a milder bias: the
modes' own 30,000 and 40,000) and must fail at p < 1e-8, far below the χ² bound, so that the
test catches it in nearly every draw of seeds, not only in this one. It is drawn in four parts
and stops after one where it already fails at p < 1e-9 (tests/stats.py, `mutant_p_value`). A branch used for the
wrong outcome is *not* among them: its drafts come with the distributions they were drawn
from, so rejection sampling keeps the output exact and only acceptance suffers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from coordinator import acceptance
from coordinator import engine as coordinator_engine
from coordinator import server as coordinator_server
from coordinator.branches import Branches
from coordinator.config import CoordinatorConfig
from coordinator.hedging import PredraftDepth
from coordinator.requests import GenerationRequest
from coordinator.rounds import draw_round
from coordinator.state import Round
from coordinator.upstream import Upstream
from specdec.engine.modeling import tokenizer_fingerprint
from specdec.rpc import wire
from specdec.sampling.chain import RoundOutcome
from specdec.v1 import common_pb2
from tests.stack import configured
from tests.stats import (
    MUTANT_P_VALUE,
    P_VALUE_FLOOR,
    chi_square_p_value,
    guaranteed_power,
    mutant_p_value,
    worst_case_bias,
)
from tests.table_services import TableDraft, TableModel, TableTarget

DETECTABLE_TV = 0.02
REQUIRED_POWER = 0.9
CONCURRENCY = 32
# (draft ms per step, target ms per pass) in Info, for the K chooser: drafts half as dear as a
# verify, so the pipelined chooser settles at short drafts and rounds continue from pre-drafts.
CHOOSER_COSTS = (20.0, 40.0)
# ... and for the overlap chosen per request (coordinator.overlap): a draft step an eighth of a
# target pass, so that pipelining pays.
ACCELERATOR_COSTS = (5.0, 40.0)


@dataclass(frozen=True)
class Mode:
    coordinator: dict
    vocab: int  # tokens in the tables (ids 0..vocab-1)
    length: int  # new tokens per generation: vocab**length outcomes
    k: int | None  # None: the K chooser decides
    min_confidence: float = 0.0  # the draft's confidence stop
    costs: tuple[float, float] | None = None
    draft_batch: int = 0  # the draft's max batch size in its Info (0: not said)
    exercised: Callable[[list, TableDraft], str | None] = field(default=lambda stats, draft: None)
    prompt: tuple[int, ...] = (1, 0, 1)
    draft_noise: float = 0.8  # how far the draft's logits are from the target's
    # Samples for the mutation check, enough that it fails at MUTANT_P_VALUE: 10,000 where its
    # bias is plain, 3,000 where at 10,000 it failed with a χ² noncentrality near 600 or more
    # (about 180 at 3,000, where p < 1e-8 needs a χ² of 66), more where it is mild; None: the
    # mode's own count.
    mutant_samples: int | None = None
    # Every pre-draft of k >= 2 drafts takes k steps, the bonus guess and k - 1 drafts, as
    # where its last step comes back after the verify (PredraftDepth; a seeded request, as
    # every one here is, never takes them on its own).
    short_predrafts: bool = False

    @property
    def samples(self) -> int:
        return samples_for_power(self.vocab**self.length)


def samples_for_power(outcomes: int, step: int = 5_000) -> int:
    """The fewest samples (a multiple of `step`) with which the χ² test over `outcomes`
    detects any bias of total variation DETECTABLE_TV with probability REQUIRED_POWER at the
    P_VALUE_FLOOR bound: noncentrality ≥ 4nδ² (the module docstring)."""
    samples = step
    while guaranteed_power(0.0, outcomes, samples, DETECTABLE_TV) < REQUIRED_POWER:
        samples += step
    return samples


def total(stats: list, name: str) -> int:
    return sum(getattr(s, name) for s in stats)


def pre_drafts_used(stats, draft) -> str | None:
    hits = total(stats, "predraft_hits")
    return None if hits > len(stats) // 20 else f"only {hits} pre-drafts were used"


def catch_ups_and_pre_drafts_used(stats, draft) -> str | None:
    """Catch-up steps (target-only rounds while the draft drafts the next) ran, and their
    pre-drafts were used."""
    steps = total(stats, "catch_up_rounds")
    return pre_drafts_used(stats, draft) or (None if steps > len(stats) // 20 else f"only {steps} catch-up steps")


def hedges_used(stats, draft) -> str | None:
    hits = total(stats, "hedge_hits")
    return None if hits > len(stats) // 20 else f"only {hits} hedges were used"


def fanned_hedges_used(stats, draft) -> str | None:
    """Hedges were used, and several recovered tokens per position were hedged. A generation's
    first round (K = 2 of 3 tokens) leaves room for a next round only after a rejection of its
    first draft, so it hedges that position alone: one fork without fan-out, two with it."""
    hedges = total(stats, "hedges")
    return hedges_used(stats, draft) or (None if hedges > 1.5 * len(stats) else f"only {hedges} hedges: no fan-out")


def bonus_guesses_used(stats, draft) -> str | None:
    """Pre-drafts were kept, some of them from a fork that guessed the bonus token by the
    draft's runner-up."""
    hits = total(stats, "bonus_guess_hits")
    return pre_drafts_used(stats, draft) or (None if hits > len(stats) // 20 else f"only {hits} runner-up guesses kept")


def hedges_and_pre_drafts_used(stats, draft) -> str | None:
    return hedges_used(stats, draft) or pre_drafts_used(stats, draft)


def pipelining_chosen(stats, draft) -> str | None:
    """The coordinator chose, unasked, to pipeline these sampled requests, without hedges
    (auto adds branches to greedy requests only), and their pre-drafts were used."""
    if not all(s.pipelined for s in stats):
        return "the coordinator did not choose to pipeline"
    if total(stats, "hedges"):
        return "the coordinator hedged a sampled request"
    return pre_drafts_used(stats, draft)


def confidence_stops(stats, draft) -> str | None:
    return None if draft.confidence_stops > len(stats) // 20 else f"only {draft.confidence_stops} confidence stops"


def chosen_k_zero_stepped(stats, draft) -> str | None:
    """Rounds the chooser made K = 0 ran further steps in their call (their rounds share the
    call's time evenly, GenerationStats.round_ms), and the chooser also speculated."""
    stepped = sum(
        1 for s in stats for k, a, b in zip(s.k_per_round[1:], s.round_ms[1:], s.round_ms[2:]) if not k and a == b
    )
    drafted = total(stats, "proposed_tokens")
    return None if stepped > len(stats) // 5 and drafted else f"{stepped} steps, {drafted} drafts"


def chooser_varied(stats, draft) -> str | None:
    ks = {k for s in stats for k in s.k_per_round}
    return pre_drafts_used(stats, draft) or (None if len(ks) > 1 else f"the chooser only ever chose K in {ks}")


# Pipelining needs 4 tokens (a first round, a catch-up step or K = 1, then a round from its pre-draft), so those
# modes use 2 tokens (16 outcomes); sequential uses 3 tokens over 3 positions (27 outcomes).
MODES = {
    "sequential": Mode({}, vocab=3, length=3, k=2, mutant_samples=10_000),
    # With catch-up steps (the default): the first round, and any after a miss, is a target-only
    # step whose pre-draft drafts the round after it.
    "pipelined": Mode(
        {"pipeline": True}, vocab=2, length=4, k=1, exercised=catch_ups_and_pre_drafts_used, mutant_samples=3_000
    ),
    "pipelined_waiting": Mode(
        {"pipeline": True, "catch_up": False}, vocab=2, length=4, k=1, exercised=pre_drafts_used, mutant_samples=3_000
    ),
    # Two tokens, so a rejected draft's recovered token is the hedge's (the draft's runner-up),
    # and a noisier draft, so rejections and hedge hits are common (`hedges_used` needs > 5%;
    # about 11,600 of 30,000 generations hit one). Its mutant's bias grows as the draft comes
    # closer to the target, past a point: at draft_noise 1.5 its χ² noncentrality was about 1.4
    # per thousand samples (it failed at p = 4.9e-5 on seeds 0-29,999, passed at 3.1e-4 on
    # 30,000-59,999), at 1.0 about 2.6 (p = 2e-13 on seeds 0-29,999), at 0.5 about 2.4.
    "hedged": Mode({"hedges": 2}, vocab=2, length=4, k=2, draft_noise=1.0, exercised=hedges_used),
    # Three tokens, so a rejected draft leaves two candidates for its recovered token, and a
    # hedge for each (the draft's two runner-ups): the fan-out.
    # Its mutant's χ² noncentrality is about 4.8 per thousand samples (218.7 over 26 degrees of
    # freedom at 40,000): at 25,000 its χ² sits 2.9 standard deviations above the 1e-8 bound.
    "hedged_fanout": Mode(
        {"hedges": 4},
        vocab=3,
        length=3,
        k=2,
        draft_noise=1.5,
        exercised=fanned_hedges_used,
        mutant_samples=25_000,
    ),
    # Pre-draft and hedges in one ProposeBranches call, stepped together.
    "batched_hedges": Mode(
        # Without catch-up steps, so that every round after the first batches its branches.
        {"pipeline": True, "hedges": 2, "catch_up": False},
        vocab=2,
        length=4,
        k=1,
        exercised=hedges_and_pre_drafts_used,
        mutant_samples=10_000,
    ),
    # The pre-draft's argmax guess of the bonus token and a fork guessing the runner-up, in one
    # ProposeBranches call: over two tokens, one of them always guesses right.
    "bonus_guesses": Mode(
        {"pipeline": True, "bonus_guesses": 2, "catch_up": False},
        vocab=2,
        length=4,
        k=1,
        draft_noise=1.5,
        exercised=bonus_guesses_used,
        mutant_samples=10_000,
    ),
    # With catch-up steps: a fully accepted round of 2 leaves no room for a pre-draft of 2
    # in 4 tokens, but a first step's pre-draft has it.
    "short_predrafts": Mode(
        {"pipeline": True},
        vocab=2,
        length=4,
        k=2,
        exercised=pre_drafts_used,
        mutant_samples=3_000,
        short_predrafts=True,
    ),
    "confidence_stopped": Mode(
        # Without catch-up steps, so that rounds after a miss make regular Propose calls.
        {"pipeline": True, "catch_up": False},
        vocab=2,
        length=4,
        k=2,
        min_confidence=0.6,
        exercised=confidence_stops,
        mutant_samples=10_000,
    ),
    "adaptive": Mode(
        {"pipeline": True},
        vocab=2,
        length=4,
        k=None,
        costs=CHOOSER_COSTS,
        exercised=chooser_varied,
        mutant_samples=10_000,
    ),
    # A draft nearly as slow as the target: the chooser mostly picks K = 0, and such a round
    # runs several target-only steps in its call (rounds.step_count), between probes.
    # Its mutant's noncentrality is about 28 per thousand samples: each of eight runs of 5,000
    # failed at p < 1e-16.
    "chooser_steps": Mode(
        {}, vocab=2, length=5, k=None, costs=(30.0, 40.0), exercised=chosen_k_zero_stepped, mutant_samples=5_000
    ),
    # No flags: the coordinator chooses the overlap (coordinator.overlap) and K.
    "chosen": Mode(
        {"pipeline": None, "hedges": None, "bonus_guesses": None},
        vocab=2,
        length=4,
        k=None,
        costs=ACCELERATOR_COSTS,
        draft_batch=32,
        exercised=pipelining_chosen,
        mutant_samples=3_000,
    ),
}


# Mutants: each biases only its mode's own path (see the module docstring).


def recovered_one_late(monkeypatch) -> None:
    """Sequential: at a rejection the round emits the target's recovered sample for the
    position after the rejected one (an off-by-one in the acceptance step)."""
    plain = acceptance.decide_round

    def late(draft_token_target_probs, draft_token_draft_probs, uniforms, recovered_token_ids, bonus_token_id):
        outcome = plain(
            draft_token_target_probs, draft_token_draft_probs, uniforms, recovered_token_ids, bonus_token_id
        )
        if outcome.num_accepted + 1 < len(recovered_token_ids):
            return RoundOutcome(outcome.num_accepted, int(recovered_token_ids[outcome.num_accepted + 1]))
        return outcome

    monkeypatch.setattr(acceptance, "decide_round", late)


def pre_draft_rows_flattened(monkeypatch) -> None:
    """Pipelined: a kept pre-draft's drafts (after its guess) go to the verify with a flat
    distribution instead of the one each was drawn from: drafts paired with the wrong
    distribution. (Keeping a pre-draft whose guess missed would not do: its drafts still come
    with their own distributions, so only acceptance suffers; docs/design.md, Hedges.)"""
    plain = Round.truncated

    def flattened(self: Round, k: int, start: int = 0) -> Round:
        kept = plain(self, k, start)
        if not start:
            return kept
        width = len(kept.distributions[0].dense.float32_le) // 4 if kept.distributions else 0
        flat = common_pb2.ProposalDistribution(dense=wire.encode_dense(torch.full((width,), 1.0 / width)))
        count = len(kept.draft_token_ids)
        return dataclasses.replace(kept, draft_token_draft_probs=[1.0 / width] * count, distributions=[flat] * count)

    monkeypatch.setattr(Round, "truncated", flattened)


def hedge_picked_by_its_drafts(monkeypatch) -> None:
    """Hedged: after a rejection the round takes the first hedge whose first draft is the
    draft's likeliest token, looking at the branches' draws (the real rule looks only at the
    verification outcome)."""
    original = Branches.pick

    async def pick_by_drafts(self, call, outcome, proposed, live):
        if not live or outcome.num_accepted == proposed or not call.forks:
            return await original(self, call, outcome, proposed, live)
        reply = await call.task
        for plan, result in zip(call.branches, reply.results):
            proposal = result.proposal
            if plan.hedge is not None and not result.error_code and proposal.token_ids:
                branch = self.upstream.round_from(proposal, plan.k, call.replica.address)
                if branch.draft_token_draft_probs[0] >= proposal.runner_up_probs[0]:  # its first draft is the argmax
                    return plan
        return None

    monkeypatch.setattr(Branches, "pick", pick_by_drafts)


def branch_rows_mixed_up(monkeypatch) -> None:
    """Batched hedges: the rows of the one batched ProposeBranches pass reach the wrong
    branches: each branch's drafts arrive with the distributions the next branch drew from."""
    plain = TableDraft.propose_branches

    async def mixed_up(self, request):
        reply = await plain(self, request)
        proposals = [result.proposal for result in reply.results]
        # The drafts' rows only: a pre-draft's guess (one-hot) is compared, never verified.
        rows = [[type(row)(dense=row.dense) for row in p.distributions if row.HasField("dense")] for p in proposals]
        for proposal, own, other in zip(proposals, rows, rows[1:] + rows[:1]):
            count = min(len(own), len(other))
            mixed = iter(other[:count] + own[count:])
            kept = [next(mixed) if row.HasField("dense") else row for row in proposal.distributions]
            del proposal.distributions[:]
            proposal.distributions.extend(kept)
        return reply

    monkeypatch.setattr(TableDraft, "propose_branches", mixed_up)


def guess_fork_rows_from_pre_draft(monkeypatch) -> None:
    """Bonus guesses: a fork that guessed by the runner-up sends its drafts with the rows the
    pre-draft (which guessed the argmax) drew its own from: a kept fork's drafts paired with
    the wrong distributions. The pre-draft's own path is left exact."""
    plain = TableDraft.propose_branches

    async def borrowed(self, request):
        reply = await plain(self, request)
        pre_draft = next(
            result.proposal
            for branch, result in zip(request.branches, reply.results)
            if branch.guess_first and not branch.guess_rank
        )
        for branch, result in zip(request.branches, reply.results):
            rows = result.proposal.distributions
            if branch.guess_rank and len(rows) > 1 and len(pre_draft.distributions) == len(rows):
                del rows[1:]
                rows.extend(pre_draft.distributions[1:])  # the guess's own one-hot row stays
        return reply

    monkeypatch.setattr(TableDraft, "propose_branches", borrowed)


def unsure_draft_dropped(monkeypatch) -> None:
    """Confidence-stopped: the coordinator drops the draft a proposal stopped on (the one drawn
    with low confidence) and verifies the rest, so which drafts are verified depends on their
    own draws."""
    original = Upstream.round_from

    def drop(self, proposal, k, *source):
        round_ = original(self, proposal, k, *source)
        if 0 < len(round_.draft_token_ids) < k:
            return round_.truncated(len(round_.draft_token_ids) - 1)
        return round_

    monkeypatch.setattr(Upstream, "round_from", drop)


def k_cut_after_drafting(monkeypatch) -> None:
    """Adaptive: the round's K is cut after the drafts are drawn, at the first draft the draft
    gave less than 1/2: K chosen by looking at the draws instead of before them."""
    original = Upstream.round_from

    def cut(self, proposal, k, *source):
        round_ = original(self, proposal, k, *source)
        keep = next((i for i, p in enumerate(round_.draft_token_draft_probs) if p < 0.5), None)
        return round_ if not keep else round_.truncated(keep)

    monkeypatch.setattr(Upstream, "round_from", cut)


def step_seeds_repeated(monkeypatch) -> None:
    """Chooser steps: a call's further steps all drawn with the seed of its first, so the
    tokens of one call are drawn from one uniform."""

    def repeated(streams, plan):
        draws = draw_round(streams, plan)
        return dataclasses.replace(draws, step_seeds=(draws.target_seed,) * len(draws.step_seeds))

    monkeypatch.setattr(coordinator_engine, "draw_round", repeated)


MUTANTS = {
    "sequential": recovered_one_late,
    "pipelined": pre_draft_rows_flattened,
    "pipelined_waiting": pre_draft_rows_flattened,
    "hedged": hedge_picked_by_its_drafts,
    "hedged_fanout": hedge_picked_by_its_drafts,
    "batched_hedges": branch_rows_mixed_up,
    "bonus_guesses": guess_fork_rows_from_pre_draft,
    "confidence_stopped": unsure_draft_dropped,
    "short_predrafts": pre_draft_rows_flattened,
    "adaptive": k_cut_after_drafting,
    "chooser_steps": step_seeds_repeated,
    "chosen": pre_draft_rows_flattened,
}


@pytest.fixture(scope="module")
def tokenizer_dir(word_pair):
    """Any real tokenizer whose ids cover the tables' few tokens: the coordinator decodes text."""
    return word_pair.target


def tables(mode: Mode) -> tuple[TableModel, TableModel]:
    target = TableModel(mode.vocab, salt=1)
    return target, TableModel(mode.vocab, salt=2, base=target, noise=mode.draft_noise)


async def sample_mode(tokenizer_dir, mode: Mode, seeds: int | range) -> tuple[list[tuple[int, ...]], list, TableDraft]:
    """Seeded generations through a coordinator in `mode`, one per seed (an int n: 0..n-1)."""
    seeds = range(seeds) if isinstance(seeds, int) else seeds
    target_model, draft_model = tables(mode)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir))
    draft_ms, target_ms = mode.costs or (None, None)
    draft = TableDraft(
        draft_model,
        fingerprint,
        pass_ms=(draft_ms,) * 9 if draft_ms else (),
        max_batch_size=mode.draft_batch,
        min_confidence=mode.min_confidence,
    )
    target = TableTarget(target_model, fingerprint, pass_ms=(target_ms,) * 9 if target_ms else ())
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(tokenizer_dir), metrics_port=-1
        ),
        mode.coordinator,
    )
    coordinator = await coordinator_server.connect(config, draft, target, rules)
    short = mock.patch.object(PredraftDepth, "steps", lambda self, k: k if k >= 2 else k + 1)
    if mode.short_predrafts:
        short.start()
    semaphore = asyncio.Semaphore(CONCURRENCY)
    collected: list = []

    async def one(seed: int) -> tuple[int, ...]:
        request = GenerationRequest(
            prompt_token_ids=mode.prompt,
            max_new_tokens=mode.length,
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=mode.k,
        )
        token_ids: list[int] = []
        async with semaphore:
            async for chunk in coordinator.generate(request):
                token_ids.extend(chunk.token_ids)
                if chunk.stats is not None:
                    collected.append(chunk.stats)
        return tuple(token_ids)

    try:
        outputs = await asyncio.gather(*(one(seed) for seed in seeds))
        repeat = await asyncio.gather(*(one(seed) for seed in seeds[:20]))
    finally:
        if mode.short_predrafts:
            short.stop()
        coordinator.close()
        await coordinator.wait_cleanup()
    assert repeat == outputs[:20], "the same seed must give the same output"
    assert total(collected, "proposed_tokens") > 0, "the draft never proposed, so nothing was tested"
    assert draft.open_sessions == 0 and target.open_sessions == 0, "a request left a session open"
    return outputs, collected, draft


@pytest.mark.parametrize("name", sorted(MODES))
async def test_mode_has_target_distribution(tokenizer_dir, name):
    mode = MODES[name]
    outputs, stats, draft = await sample_mode(tokenizer_dir, mode, mode.samples)
    problem = mode.exercised(stats, draft)
    assert problem is None, f"{name}: {problem}; the mode's own path is barely exercised"
    expected = tables(mode)[0].continuations(mode.prompt, mode.length)
    p_value = chi_square_p_value(outputs, expected)
    assert p_value > P_VALUE_FLOOR, f"{name}: χ² p-value {p_value:.2e}; output is not the target's distribution"


@pytest.mark.parametrize("name", sorted(MUTANTS))
async def test_mode_test_detects_its_mutant(tokenizer_dir, name, monkeypatch):
    mode = MODES[name]
    MUTANTS[name](monkeypatch)
    expected = tables(mode)[0].continuations(mode.prompt, mode.length)

    async def draw(seeds: range) -> list[tuple[int, ...]]:
        return (await sample_mode(tokenizer_dir, mode, seeds))[0]

    p_value, drawn = await mutant_p_value(draw, expected, mode.mutant_samples or mode.samples)
    print(f"{name}'s mutant: p = {p_value:.2e} after {drawn} samples")
    assert p_value < MUTANT_P_VALUE, f"{name}: the mutant failed only at p = {p_value:.2e}; the test lacks power"


@pytest.mark.parametrize("name", sorted(MODES))
def test_power(name):
    """Each mode's test detects any bias of total variation DETECTABLE_TV with probability at
    least REQUIRED_POWER at the p < 1e-4 bound (the noncentral χ² bound in the module
    docstring), and does fail on a sample drawn from the worst case for χ²: the mass moved
    in proportion to p from the likeliest outcomes to the others."""
    mode = MODES[name]
    expected = tables(mode)[0].continuations(mode.prompt, mode.length)
    outcomes = len(expected)
    power = guaranteed_power(0.0, outcomes, mode.samples, DETECTABLE_TV)  # no outcome pooled
    assert power >= REQUIRED_POWER, f"{name}: power {power:.3f} over {outcomes} outcomes"

    keys, biased = worst_case_bias(expected, DETECTABLE_TV)
    counts = np.random.default_rng(0).multinomial(mode.samples, biased)
    drawn = [key for key, count in zip(keys, counts) for _ in range(count)]
    assert chi_square_p_value(drawn, expected) < P_VALUE_FLOOR
