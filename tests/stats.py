"""Goodness-of-fit helpers for the distribution tests, and the power they have.

Power against any bias of total variation δ, whatever its shape: with the outcomes the test
keeps as cells of their own and the rest pooled into one cell of mass m under the target,
the binned distributions are at least δ − m apart (a bias inside the pool is invisible, and
it moves at most m), and the χ² noncentrality is then ≥ 4n(δ − m)² (Cauchy-Schwarz). So the
power is at least that of a noncentral χ² with (cells − 1) degrees of freedom and that
noncentrality, at the P_VALUE_FLOOR bound (`guaranteed_power`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
from scipy import stats

# A χ² test at this level fails a correct sampler once in 10,000 seeds; with fixed seeds the
# outcome is deterministic, and the power checks show the tests do detect a wrong sampler.
P_VALUE_FLOOR = 1e-4
# A mutant (a sampler made inexact on purpose) must fail far below that: its samples are one
# seeded draw, and one that fails just under the floor says the test catches that bug in about
# half the draws (the hedge mutant of test_mode_distributions.py did, at 4.9e-5, and passed on
# the next 30,000 seeds).
MUTANT_P_VALUE = 1e-8
# A mutant check may stop early (`mutant_p_value`): at a look before its last, only below this.
# Ten times stricter than the final bound, so over a few looks a bias too mild to fail the full
# sample is no likelier to be declared caught than at the full sample alone, and the χ² tail's
# approximation over cells of few expected samples has room to err.
INTERIM_P_VALUE = MUTANT_P_VALUE / 10


def chi_square_p_value(
    samples: list[tuple[int, ...]],
    expected_probs: dict[tuple[int, ...], float],
    cells: frozenset[tuple[int, ...]] | None = None,
) -> float:
    """χ² goodness of fit over `cells` (outcomes tested alone; the rest pooled into one bin),
    by default the outcomes expected at least 5 times."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, p in expected_probs.items():
        if outcome in cells if cells is not None else p * n >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += p * n
    unexpected = sum(c for o, c in counts.items() if o not in expected_probs)
    observed.append(pooled_obs + unexpected)
    expected.append(pooled_exp)
    if expected[-1] == 0:
        assert observed[-1] == 0, "samples fell on outcomes of probability 0"
        observed, expected = observed[:-1], expected[:-1]
    expected_arr = np.asarray(expected)
    expected_arr *= sum(observed) / expected_arr.sum()  # float32 row sums are 1 only to ~1e-7
    return float(stats.chisquare(observed, expected_arr).pvalue)


def guaranteed_power(pooled_mass: float, cells: int, samples: int, tv: float) -> float:
    """The least power of a χ² test over `cells` cells (one of them the pool, of mass
    `pooled_mass`) against any bias of total variation `tv` (the module docstring)."""
    if cells < 2 or pooled_mass >= tv:
        return 0.0
    critical = stats.chi2.ppf(1 - P_VALUE_FLOOR, cells - 1)
    return float(stats.ncx2.sf(critical, cells - 1, 4 * samples * (tv - pooled_mass) ** 2))


def powered_cells(
    expected_probs: dict[tuple[int, ...], float], samples: int, tv: float
) -> tuple[float, frozenset[tuple[int, ...]]]:
    """The outcomes to test alone (the likeliest, each expected at least 5 times; the rest
    pooled) that give `samples` draws the most `guaranteed_power` against a bias of `tv`:
    → (that power, those outcomes)."""
    ranked = sorted(expected_probs, key=expected_probs.get, reverse=True)
    best: tuple[float, int] = (0.0, 0)
    kept_mass = 0.0
    for count, outcome in enumerate(ranked, start=1):
        if expected_probs[outcome] * samples < 5:
            break
        kept_mass += expected_probs[outcome]
        best = max(best, (guaranteed_power(max(0.0, 1.0 - kept_mass), count + 1, samples, tv), count))
    return best[0], frozenset(ranked[: best[1]])


def samples_for_power(
    expected_probs: dict[tuple[int, ...], float], tv: float, power: float, step: int = 1000, limit: int = 100_000
) -> int:
    """The fewest samples (a multiple of `step`) whose `powered_cells` reach `power` against
    a bias of total variation `tv`."""
    samples = step
    while powered_cells(expected_probs, samples, tv)[0] < power:
        samples += step
        assert samples <= limit, f"over {limit} samples for power {power} at a distance of {tv}"
    return samples


def worst_case_bias(
    expected_probs: dict[tuple[int, ...], float], tv: float
) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The outcomes, likeliest first, and a distribution over them at total variation `tv`
    from `expected_probs` that χ² finds hardest to tell apart: the mass moved in proportion to
    p from the likeliest outcomes (about half the mass) to the others."""
    keys = sorted(expected_probs, key=expected_probs.get, reverse=True)
    probs = np.array([expected_probs[key] for key in keys])
    head = np.cumsum(probs) - probs < 0.5  # the likeliest outcomes, about half the mass
    biased = probs.copy()
    biased[head] -= tv * probs[head] / probs[head].sum()
    biased[~head] += tv * probs[~head] / probs[~head].sum()
    assert np.isclose(0.5 * np.abs(biased - probs).sum(), tv)
    return keys, biased


async def mutant_p_value(
    draw: Callable[[range], Awaitable[list[tuple[int, ...]]]],
    expected_probs: dict[tuple[int, ...], float],
    samples: int,
    cells: frozenset[tuple[int, ...]] | None = None,
    looks: int = 4,
) -> tuple[float, int]:
    """A mutant check's χ² p-value over seeds 0..samples-1, drawn in `looks` equal parts
    (`draw(seeds)` → their outcomes), stopping at the first part after which the p-value over
    everything drawn is below INTERIM_P_VALUE: a noncentrality grows with the samples, so a
    mutant caught that clearly on fewer would be caught on all. Interim looks pool outcomes
    expected fewer than 5 times so far; the last uses `cells`. → (p-value, samples drawn)."""
    drawn: list[tuple[int, ...]] = []
    for look in range(1, looks):
        drawn += await draw(range(len(drawn), samples * look // looks))
        p_value = chi_square_p_value(drawn, expected_probs)
        if p_value < INTERIM_P_VALUE:
            return p_value, len(drawn)
    drawn += await draw(range(len(drawn), samples))
    return chi_square_p_value(drawn, expected_probs, cells), len(drawn)
