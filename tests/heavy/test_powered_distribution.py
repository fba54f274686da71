"""End-to-end χ² tests with power (issue 65): the real services, in process, detect any bias of
total variation 0.05 with probability at least 0.9.

test_distribution.py's cases draw 3,000 generations over 12³ continuations of a spread-out
target, so most outcomes are pooled and only a gross error fails them. Here the target is
peaked (tests/conftest.py's peaked_word_pair): its likeliest continuations hold nearly all the
mass, so a few thousand generations over a few dozen cells reach the power stated in
tests/stats.py (the pooled mass m counts against the distance: noncentrality ≥ 4n(0.05 − m)²).
Each case draws the fewest samples that give power ≥ 0.9 (`samples_for_power`), checks that a
worst-case biased sample of that size fails, and the configurations issue 65 found inexact
run a mutant that reproduces the old behaviour and must fail the same test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from coordinator.state import Round, Source
from coordinator.upstream import Upstream
from draft_service.runner import DraftRunner
from specdec.sampling import probs as probs_module
from specdec.sampling import together as together_module
from specdec.sampling.probs import SamplingParams
from specdec.tools.testing import TinyPair
from tests.heavy.test_distribution import exact_target_distribution, sample_continuations
from tests.stack import local_stack
from tests.stats import (
    MUTANT_P_VALUE,
    P_VALUE_FLOOR,
    chi_square_p_value,
    mutant_p_value,
    powered_cells,
    samples_for_power,
    worst_case_bias,
)

DETECTABLE_TV = 0.05
REQUIRED_POWER = 0.9
T1 = SamplingParams(temperature=1.0)
PROMPT = (3, 7)
REPEATING_PROMPT = (3, 7, 5, 3, 7)
FOREIGN_IDS = (0, 1, 2)  # the target's w0..w2, which the bridged draft's vocabulary lacks
FOREIGN_SHARE = 0.3  # of each hostile draft row's mass, spread over FOREIGN_IDS
LOCAL_BATCH = {"max_batch_size": 32, "max_sessions": 256}
CONCURRENCY = 64
# A mutant's bias is far above 0.05 (each failed at p < 1e-8 with this many, the default path's at
# 1.4e-9): half the time. Drawn in four parts, it stops after one where it already fails at
# p < 1e-9 (tests/stats.py, `mutant_p_value`): the budgeted draft's after 750.
MUTANT_SAMPLES = 3000
PREFIX_CACHE = {"prefix_cache_bytes": 1 << 22, "prefix_block_tokens": 2}


def hostile_foreign_draws(monkeypatch) -> None:
    """A buggy or hostile bridged draft: each sampled row moves FOREIGN_SHARE of its mass to
    ids it does not share, and draws from the mixed row (a foreign id with that probability,
    else its own draw), sending the mixed row: every draft still comes with the distribution
    it was drawn from, so exact verification keeps the target's distribution."""
    plain = DraftRunner._take

    def take(self, drafting, row, drawn_prob, runner_ups, head_probs, support, batch_size) -> None:
        plain(self, drafting, row, drawn_prob, runner_ups, head_probs, support, batch_size)
        if drafting.deterministic:
            return
        mixed = drafting.rows[-1] * (1.0 - FOREIGN_SHARE)  # [V]
        mixed[list(FOREIGN_IDS)] += FOREIGN_SHARE / len(FOREIGN_IDS)
        drafting.rows[-1] = mixed
        drafting.supports[-1] = None  # dense: the mixed row's support is not the head's
        if drafting.generator.random() < FOREIGN_SHARE:
            drafting.token_ids[-1] = int(drafting.generator.choice(FOREIGN_IDS))

    monkeypatch.setattr(DraftRunner, "_take", take)


def discard_foreign_rounds(monkeypatch) -> None:
    """Mutant, the behaviour before issue 65: a reply with a foreign draft runs its round
    target-only (a branch's counts as failed), so only rounds that drew no foreign id survive."""
    plain = Upstream.round_from

    def round_from(self, proposal, k, address, source=Source.DRAFT) -> Round:
        drafts = plain(self, proposal, k, address, source)
        return Round(Source.FALLBACK if source is Source.DRAFT else source) if drafts.foreign else drafts

    monkeypatch.setattr(Upstream, "round_from", round_from)


def refuse_mid_proposal(monkeypatch) -> None:
    """Mutant, the behaviour before issue 65: no cap from the KV budget, so a proposal is
    refused at the draft that outgrows it, unless a confidence stop ended it first."""
    monkeypatch.setattr(DraftRunner, "_room", lambda self, session, feed, wanted: wanted)


def recovered_from_the_target(monkeypatch) -> None:
    """Mutant for the default path: a rejected draft is replaced by a sample of p itself, not of
    the residual max(0, p − q), by a call concluded alone or with the others of its pass."""
    for module in (probs_module, together_module):
        monkeypatch.setattr(module, "residual_probs", lambda target_probs, draft_probs: target_probs)


def rows_not_drawn_from(monkeypatch) -> None:
    """Mutant for the bridged draft: the rows it ships over the caller's ids are not the ones it
    samples from: half of each row's mass spread evenly over the row's ids. (Rows left with the
    mass they had before the cut to the shared tokens, the bug this mutant modelled first, no
    longer reach the output: the target refuses a row whose mass is not 1, test_guards.py.)"""
    plain = DraftRunner._over_vocab

    def shipped(self, head_probs):
        rows = plain(self, head_probs)  # [n, V]
        support = (rows > 0).float()
        return 0.5 * rows + 0.5 * support / support.sum(dim=-1, keepdim=True)

    monkeypatch.setattr(DraftRunner, "_over_vocab", shipped)


def budget_of_the_prompt(draft_runner, target_runner) -> None:
    """The draft's KV budget holds the prompt alone: the first proposal may draw one token
    (the prompt's entries), every later call is refused, before its draws, by its own feed."""
    draft_runner.sessions.max_kv_bytes = len(PROMPT) * draft_runner.kv_bytes_per_token


@dataclass(frozen=True)
class Case:
    draft: dict = field(default_factory=dict)  # draft service overrides
    coordinator: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    prompt: tuple[int, ...] = PROMPT
    length: int = 3
    k: int | None = 2
    bridged: bool = False  # the draft speaks its own vocabulary (peaked_bridged_pair)
    self_drafted: bool = False  # the target's own checkpoint drafts (q = p)
    setup: Callable | None = None  # (monkeypatch): what the draft does in this case
    prepare: Callable | None = None  # (draft_runner, target_runner) before the services start
    mutant: Callable | None = None  # (monkeypatch): a bug, or the old behaviour, that must fail


CASES = {
    # The services' declared defaults: sequential rounds, confidence stops at 0.4, K unset
    # (no calibrated costs here, so --num-speculative-tokens).
    "default": Case(draft={"min_confidence": 0.4}, k=None, mutant=recovered_from_the_target),
    # Every speed path of a pipelined round at once: pre-drafts, hedges on rejection outcomes,
    # and the bonus token guessed three ways on forks.
    # At the draft's default --min-confidence 0.4, where a fork guessing a runner-up used to
    # stop at its guess and could never be kept.
    "all_hedged_bonus_guesses": Case(
        draft={"quantize": "none", "min_confidence": 0.4},
        coordinator={"pipeline": True, "hedges": 2, "bonus_guesses": 3, "catch_up": False},
        prompt=REPEATING_PROMPT,
        length=4,
        k=1,
    ),
    "bridged_draft": Case(draft={"quantize": "none"}, bridged=True, mutant=rows_not_drawn_from),
    "bridged_draft_with_foreign_draws": Case(
        draft={"quantize": "none"}, bridged=True, setup=hostile_foreign_draws, mutant=discard_foreign_rounds
    ),
    # Both services start every request after the first from cached prompt blocks.
    "prefix_cache_hits": Case(draft={"quantize": "none", **PREFIX_CACHE}, target=PREFIX_CACHE, prompt=REPEATING_PROMPT),
    # One proposal at a time (no batching), confidence stops on, a budget that refuses a
    # second draft: before issue 65 only proposals stopped after their first draft survived.
    # The target drafts for itself, as in the example (p = q): the old behaviour's bias
    # is largest where the draft agrees with the target (here 0.84 × 0.16 = 0.14 in total
    # variation at the first token), while the peaked pair's draft, confident in a token the
    # target gives 0.007, would have hidden it.
    "kv_budgeted_draft": Case(
        draft={"quantize": "none", "min_confidence": 0.4, "max_batch_size": 1},
        self_drafted=True,
        prepare=budget_of_the_prompt,
        mutant=refuse_mid_proposal,
    ),
}


def expected_of(case: Case, pair) -> dict[tuple[int, ...], float]:
    return exact_target_distribution(pair.target, T1, pair.vocab_size, list(case.prompt), case.length)


def check_paths(case: Case, stats: list, stack) -> None:
    """The case's path ran often enough to be what the sample tests."""
    if case.coordinator.get("hedges"):
        hedge_hits, guess_hits = sum(s.hedge_hits for s in stats), sum(s.bonus_guess_hits for s in stats)
        assert hedge_hits > len(stats) // 50 and guess_hits > len(stats) // 100, (hedge_hits, guess_hits)
    if case.setup is hostile_foreign_draws:
        foreign = sum(s.foreign_tokens for s in stats)
        assert foreign > len(stats) // 10, f"only {foreign} foreign drafts were verified"
        assert sum(s.fallback_rounds for s in stats) == 0
    if case.target.get("prefix_cache_bytes"):
        assert stack.target_runner.sessions.prefix.hits > len(stats) // 2
        assert stack.draft_runner.sessions.prefix.hits > len(stats) // 2
    if case.prepare is budget_of_the_prompt:
        # Capped at the one draft the budget holds (K = 2 asked); the round after has one
        # token to go, so no draft call (the cap below 1 is test_kv_budget.py's).
        first = sum(1 for s in stats if s.k_per_round and s.k_per_round[0] == 1)
        assert first == len(stats), f"only {first} first rounds drafted the one token the budget holds"
    if case.k is None:
        assert stack.draft_runner.confidence_stops > 0, "no proposal stopped on confidence"


async def draw(case: Case, pair, seeds: range, check: bool) -> list[tuple[int, ...]]:
    """Seeded generations through the case's stack, one per seed; `check`: that its path ran."""
    draft = {**(LOCAL_BATCH if case.draft.get("max_batch_size") is None else {}), **case.draft}
    if case.bridged:
        draft["target_tokenizer"] = str(pair.target)
    async with local_stack(
        pair,
        draft_overrides=draft,
        coordinator_overrides=case.coordinator,
        target_overrides={**LOCAL_BATCH, **case.target},
        prepare_runners=case.prepare,
    ) as stack:
        stats: list = []
        drawn = await sample_continuations(stack.stub, T1, seeds, case.prompt, case.length, case.k, stats, CONCURRENCY)
        if check:
            check_paths(case, stats, stack)
    return drawn


def pair_of(case: Case, request) -> TinyPair:
    pair = request.getfixturevalue("peaked_bridged_pair" if case.bridged else "peaked_word_pair")
    return TinyPair(pair.target, pair.target, pair.vocab_size, None) if case.self_drafted else pair


@pytest.mark.parametrize("name", sorted(CASES))
def test_power_at_a_distance_of_0_05(name, request):
    """Each case's sample size detects any bias of total variation 0.05 with probability ≥ 0.9
    (tests/stats.py's bound), and a worst-case biased sample of that size fails: the mass moved
    in proportion to p from the likeliest outcomes (about half of it) to the others."""
    case = CASES[name]
    expected = expected_of(case, pair_of(case, request))
    samples = samples_for_power(expected, DETECTABLE_TV, REQUIRED_POWER)
    power, cells = powered_cells(expected, samples, DETECTABLE_TV)
    assert power >= REQUIRED_POWER and samples <= 12_000, (samples, power, len(cells))
    keys, biased = worst_case_bias(expected, DETECTABLE_TV)
    counts = np.random.default_rng(0).multinomial(samples, biased / biased.sum())
    drawn = [key for key, count in zip(keys, counts) for _ in range(count)]
    assert chi_square_p_value(drawn, expected, cells) < P_VALUE_FLOOR


RUNS = [(name, "exact") for name in sorted(CASES)] + [
    (name, "mutant") for name in sorted(CASES) if CASES[name].mutant is not None
]


@pytest.mark.parametrize(("name", "variant"), RUNS)
async def test_sampled_output_has_the_target_distribution_with_power(name, variant, request, monkeypatch):
    """The exact runs pass; each mutant (the old behaviour of a configuration issue 65 found
    inexact, or a bug on the default path) fails. The hedged and prefix-cache paths' mutants
    run against lookup-table services in test_mode_distributions.py and test_prefix_cache.py."""
    case = CASES[name]
    pair = pair_of(case, request)
    expected = expected_of(case, pair)
    samples = samples_for_power(expected, DETECTABLE_TV, REQUIRED_POWER) if variant == "exact" else MUTANT_SAMPLES
    _, cells = powered_cells(expected, samples, DETECTABLE_TV)
    if case.setup is not None:
        case.setup(monkeypatch)
    if variant == "mutant":
        case.mutant(monkeypatch)
    if variant == "exact":
        drawn = await draw(case, pair, range(samples), check=True)
        p_value, count = chi_square_p_value(drawn, expected, cells), len(drawn)
    else:  # stops early where it already fails far below the bound (tests/stats.py)
        p_value, count = await mutant_p_value(lambda seeds: draw(case, pair, seeds, False), expected, samples, cells)
    print(f"{name} {variant}: {count} samples, {len(cells)} cells, p = {p_value:.3g}")
    if variant == "exact":
        assert p_value > P_VALUE_FLOOR, f"{name}: χ² p-value {p_value:.2e} over {samples} samples"
    else:
        assert p_value < MUTANT_P_VALUE, (
            f"{name}: the mutant failed only at p = {p_value:.2e}; the test lacks power for it"
        )
