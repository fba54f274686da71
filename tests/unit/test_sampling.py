"""The rejection-sampling math: named cases, and a fixed-seed χ² test that the committed
tokens are distributed exactly as the target's own samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.errors import InvalidArgument
from specdec.sampling.chain import count_accepted, decide_round
from specdec.sampling.probs import (
    SamplingParams,
    biased,
    check_logit_bias,
    check_penalties,
    logits_to_probs,
    penalized,
    residual_probs,
    row_argmax,
    sample,
    truncate_top_k,
    verify_outputs,
)
from tests.stats import P_VALUE_FLOOR, chi_square_p_value

# --- logits processing -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
    ],
)
def test_logits_to_probs_matches_transformers_warpers(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3  # [N, V]
    warped = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        warped = TopKLogitsWarper(params.top_k)(None, warped)
    if params.top_p < 1.0:
        warped = TopPLogitsWarper(params.top_p)(None, warped)
    expected = torch.softmax(warped, dim=-1)
    torch.testing.assert_close(logits_to_probs(logits, params), expected)


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 5.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # ties go to the first index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_is_torchs_argmax_ties_nans_and_infinities_included(dtype):
    """The CPU argmax through numpy (row_argmax) gives what torch's does, index for index: the
    first of tied maxima, the first NaN, +inf, rows all -inf, strided views, any leading shape;
    bfloat16 takes torch's own."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(600):
        shape = [(), (1,), (5,), (3, 2)][trial % 4]
        width = [1, 2, 7, 100, 151_936][trial % 5]
        x = torch.randn(*shape, width + 2, generator=generator)
        kind = trial % 6
        if kind == 1:
            x = torch.round(x)  # ties
        elif kind == 2:
            x = torch.where(torch.rand(x.shape, generator=generator) < 0.5, float("-inf"), x)
            x[..., 0] = float("-inf") if trial % 12 == 2 else x[..., 0]
        elif kind == 3:
            x.view(-1)[torch.randint(x.numel(), (3,), generator=generator)] = float("nan")
        elif kind == 4:
            x.view(-1)[torch.randint(x.numel(), (2,), generator=generator)] = float("inf")
        x = x.to(dtype)[..., 1:-1]  # strided along the rows
        got, want = row_argmax(x), x.argmax(dim=-1)
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), (trial, got, want)
    assert torch.equal(row_argmax(torch.full((2, 4), float("-inf"), dtype=dtype)), torch.zeros(2, dtype=torch.int64))


def test_top_p_keeps_most_likely_token_even_when_it_alone_exceeds_top_p():
    probs = logits_to_probs(torch.tensor([10.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.1))
    assert probs.tolist() == [1.0, 0.0, 0.0]


def test_truncate_top_k_renormalises():
    probs = truncate_top_k(torch.tensor([0.5, 0.3, 0.2]), 2)
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0]))


# --- residual and acceptance ---------------------------------------------------------------


def test_residual_is_normalised_positive_part():
    target_probs = torch.tensor([[0.5, 0.3, 0.2]])
    draft_probs = torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual_probs(target_probs, draft_probs), torch.tensor([[1.0, 0.0, 0.0]]))


def test_residual_with_no_mass_falls_back_to_target_without_nan():
    target_probs = torch.tensor([[0.25, 0.75]])
    residual = residual_probs(target_probs, target_probs.clone())
    assert torch.isfinite(residual).all()
    torch.testing.assert_close(residual, target_probs)


def test_perfect_match_accepts_all():
    assert count_accepted([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.99, 0.5, 0.0]) == 3


def test_early_mismatch_stops_at_first_rejection():
    outcome = decide_round([1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.3, 0.3, 0.3], [7, 8, 9], bonus_token_id=10)
    assert (outcome.num_accepted, outcome.next_token_id) == (1, 8)
    assert outcome.committed([4, 5, 6]) == [4, 8]


def test_all_accepted_emits_bonus():
    outcome = decide_round([0.9, 0.9], [0.5, 0.5], [0.9, 0.9], [7, 8], bonus_token_id=10)
    assert outcome.committed([4, 5]) == [4, 5, 10]
    assert outcome.is_bonus(2)


def test_token_with_zero_target_probability_is_never_accepted():
    assert count_accepted([0.0], [1e-9], [0.0]) == 0


def test_acceptance_ratio_above_one_always_accepts():
    assert count_accepted([0.5], [0.25], [0.999999]) == 1


def test_no_draft_tokens_emits_bonus_only():
    generator = np.random.default_rng(0)
    outputs = verify_outputs(
        torch.tensor([[0.0, 1.0]]), torch.empty(0, 2), torch.empty(0, dtype=torch.int64), generator
    )
    assert outputs.bonus_token_id == 1 and outputs.recovered_token_ids.numel() == 0


# --- losslessness -------------------------------------------------------------------------

VOCAB = 6
SEQUENCE_LENGTH = 3
NUM_DRAFT = 2
TRIALS = 12_000


def _random_rows(seed: int, concentration: float) -> torch.Tensor:
    """[VOCAB, VOCAB]: row p = distribution of the next token after token p (a bigram model)."""
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([concentration] * VOCAB, size=VOCAB), dtype=torch.float32)


def _top_k_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    return truncate_top_k(rows, k)


def _one_hot_rows(rows: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(rows.argmax(-1), VOCAB).float()


def _speculative_sample(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, seed: int, trials: int = TRIALS
) -> list[tuple[int, ...]]:
    """Full speculative decoding of SEQUENCE_LENGTH tokens after token 0, many times, using the
    real target-side (verify_outputs) and coordinator-side (decide_round) functions."""
    generator = torch.Generator().manual_seed(seed)  # the draft's draws
    target_generator = np.random.default_rng((seed, 1))  # the target's, as the services draw them
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(trials):
        sequence = [0]
        while len(sequence) <= SEQUENCE_LENGTH:
            k = min(NUM_DRAFT, SEQUENCE_LENGTH - (len(sequence) - 1) - 1)
            draft_tokens, prev = [], sequence[-1]
            for _ in range(k):
                prev = int(torch.multinomial(draft_rows[prev], 1, generator=generator))
                draft_tokens.append(prev)
            contexts = [sequence[-1], *draft_tokens]  # the token each target position follows
            target_probs = target_rows[contexts]  # [K + 1, V]
            draft_probs = draft_rows[contexts[:-1]]  # [K, V]
            outputs = verify_outputs(
                target_probs, draft_probs, torch.tensor(draft_tokens, dtype=torch.int64), target_generator
            )
            outcome = decide_round(
                outputs.draft_token_target_probs.tolist(),
                [float(draft_probs[i, t]) for i, t in enumerate(draft_tokens)],
                rng.random(k).tolist(),
                outputs.recovered_token_ids.tolist(),
                outputs.bonus_token_id,
            )
            sequence.extend(outcome.committed(draft_tokens))
        samples.append(tuple(sequence[1 : SEQUENCE_LENGTH + 1]))
    return samples


def _sequence_probs(rows: torch.Tensor) -> dict[tuple[int, ...], float]:
    probs = {(): 1.0}
    for _ in range(SEQUENCE_LENGTH):
        probs = {
            seq + (tok,): p * float(rows[seq[-1] if seq else 0, tok])
            for seq, p in probs.items()
            for tok in range(VOCAB)
        }
    return probs


TARGET_ROWS = _random_rows(1, concentration=0.8)
DRAFT_ROWS = _random_rows(2, concentration=0.8)

CASES = {
    "full_draft_distribution": (TARGET_ROWS, DRAFT_ROWS),
    "truncated_top_k_draft": (TARGET_ROWS, _top_k_rows(DRAFT_ROWS, 2)),
    "one_hot_draft": (TARGET_ROWS, _one_hot_rows(DRAFT_ROWS)),
    "target_with_zero_probabilities": (_top_k_rows(TARGET_ROWS, 3), DRAFT_ROWS),
    "draft_equals_target": (TARGET_ROWS, TARGET_ROWS),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_committed_tokens_follow_target_distribution(case):
    target_rows, draft_rows = CASES[case]
    samples = _speculative_sample(target_rows, draft_rows, seed=1234)
    expected = _sequence_probs(target_rows)
    impossible = {seq for seq, p in expected.items() if p == 0.0}
    assert not impossible.intersection(samples), "a token the target gives probability 0 was emitted"
    p_value = chi_square_p_value(samples, expected)
    assert p_value > P_VALUE_FLOOR, f"{case}: χ² p-value {p_value:.2e} says the output is not the target's"


def test_chi_square_detects_the_draft_distribution():
    """Power check: samples drawn from the draft alone must fail the same test."""
    generator = torch.Generator().manual_seed(99)
    samples = []
    for _ in range(TRIALS):
        seq, prev = [], 0
        for _ in range(SEQUENCE_LENGTH):
            prev = int(torch.multinomial(DRAFT_ROWS[prev], 1, generator=generator))
            seq.append(prev)
        samples.append(tuple(seq))
    assert chi_square_p_value(samples, _sequence_probs(TARGET_ROWS)) < 1e-12


def test_greedy_target_always_gives_target_argmax_path():
    expected_path, prev = [], 0
    for _ in range(SEQUENCE_LENGTH):
        prev = int(TARGET_ROWS[prev].argmax())
        expected_path.append(prev)
    samples = _speculative_sample(_one_hot_rows(TARGET_ROWS), DRAFT_ROWS, seed=7, trials=300)
    assert set(samples) == {tuple(expected_path)}


def test_sample_draws_in_proportion_and_never_draws_zero_mass():
    generator = np.random.default_rng(3)
    weights = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0]])  # unnormalised on purpose
    draws = sample(weights.repeat(50_000, 1), generator)
    counts = torch.bincount(draws, minlength=6).tolist()
    assert counts[0] == counts[2] == counts[5] == 0
    p_value = stats.chisquare(counts[1:2] + counts[3:5], [10_000, 25_000, 15_000]).pvalue
    assert p_value > P_VALUE_FLOOR


def test_rows_with_a_generator_each_draw_what_each_would_draw_alone():
    """A draft's pass samples several calls' rows at once: each row takes its own call's next
    draw, so a call's tokens do not depend on which calls shared its pass."""
    probs = torch.softmax(torch.randn(5, 40, generator=torch.Generator().manual_seed(0)), dim=-1)  # [5, 40]
    seeds = [11, 12, 13, 14, 15]
    alone = [
        [int(sample(probs[row : row + 1], generator)[0]) for _ in range(30)]
        for row, generator in enumerate(np.random.default_rng(seed) for seed in seeds)
    ]
    generators = [np.random.default_rng(seed) for seed in seeds]
    together = [sample(probs, generators).tolist() for _ in range(30)]  # 30 passes of 5 rows
    assert [[draws[row] for draws in together] for row in range(5)] == alone
    assert len({tuple(draws) for draws in alone}) == 5


def test_sample_uses_the_whole_64_bit_seed():
    """torch's CPU generator keeps only a seed's low 32 bits; the services' draws must not."""
    probs = torch.full((64, 1000), 1.0)
    draws = {seed: sample(probs, np.random.default_rng(seed)).tolist() for seed in (7, 7 + 2**32, 7 + 2**40)}
    assert len({tuple(d) for d in draws.values()}) == 3
    # What the services used before: torch's generator gives seeds 2**32 apart the same draws.
    same = [torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist() for seed in (7, 7 + 2**32)]
    assert same[0] == same[1]


def test_a_logit_bias_adds_to_its_tokens_logits_and_bad_ones_are_refused():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])  # [2, 3]
    params = SamplingParams(logit_bias=check_logit_bias({2: -100.0, 0: 0.5}))
    assert params.logit_bias == ((0, 0.5), (2, -100.0))  # ids increasing
    assert torch.equal(biased(logits, params), torch.tensor([[0.5, 1.0, -98.0], [3.5, 4.0, -95.0]]))
    assert biased(logits, SamplingParams()) is logits  # nothing to add: no copy
    assert logits_to_probs(biased(logits, params), params).argmax(-1).tolist() == [1, 1]
    for bad, message in (({-1: 1.0}, "ids are >= 0"), ({1: 100.5}, r"\[-100, 100\]"), ({1: math.nan}, "values")):
        with pytest.raises(InvalidArgument, match=message):
            check_logit_bias(bad)
    with pytest.raises(InvalidArgument, match="at most 300"):
        check_logit_bias(dict.fromkeys(range(301), 1.0))


def test_penalties_count_what_each_rows_sequence_holds():
    """Row i follows history + drafts[:i]: repetition_penalty scales every token seen (prompt
    included), presence and frequency count only generated ones, drafts included."""
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]]).repeat(3, 1)  # [3, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    history, output_start, drafts = [0, 3, 3], 1, [1, 3]  # prompt [0]; generated [3, 3]
    out = penalized(logits, params, history, output_start, drafts)
    # Row 0: seen {0, 3}; generated counts {3: 2}.
    assert out[0].tolist() == pytest.approx([1.0, -1.0, 1.0, 0.25 - 0.5 - 0.5])
    # Row 1 adds draft 1 (generated once), row 2 adds draft 3 (a third 3).
    assert out[1].tolist() == pytest.approx([1.0, -2.0 - 0.25 - 0.5, 1.0, 0.25 - 0.5 - 0.5])
    assert out[2].tolist() == pytest.approx([1.0, -2.0 - 0.25 - 0.5, 1.0, 0.25 - 0.75 - 0.5])
    assert penalized(logits, SamplingParams(), history, output_start, drafts) is logits
    with pytest.raises(InvalidArgument, match="presence_penalty"):
        check_penalties(2.5, 0.0, 1.0)
    with pytest.raises(InvalidArgument, match="repetition_penalty"):
        check_penalties(0.0, 0.0, 0.0)


def test_rows_cut_to_top_k_together_are_bitwise_the_rows_cut_alone():
    """top_k_parts over [B, V] (a batch of draft steps, a tree level) gives each row exactly what
    the row alone gives, on several threads and a vocabulary past torch's reduction grain,
    where a [B, V] sum rounds apart from a [V] one."""
    from specdec.sampling.probs import top_k_parts

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        probs = torch.softmax(torch.randn(6, 151_936, generator=generator) * 4, dim=-1)  # [B, V]
        kept, parts = top_k_parts(probs, 256)
        for row in range(probs.shape[0]):
            alone, alone_parts = top_k_parts(probs[row], 256)
            assert torch.equal(kept[row], alone) and torch.equal(parts[row], alone_parts), row
    finally:
        torch.set_num_threads(threads)
