"""tests/stats.py's `mutant_p_value`: a mutant check drawn in parts stops after the first part
that already fails far below the bound, and otherwise draws every seed once, in order, with
the last look over the cells it was given."""

from __future__ import annotations

import numpy as np

from tests.stats import INTERIM_P_VALUE, MUTANT_P_VALUE, chi_square_p_value, mutant_p_value

EXPECTED = {(0,): 0.5, (1,): 0.3, (2,): 0.2}


def sampler(probs: list[float]):
    """draw(seeds): one outcome a seed, each from its own seeded generator; records the seeds."""
    asked: list[range] = []

    async def draw(seeds: range) -> list[tuple[int, ...]]:
        asked.append(seeds)
        return [(int(np.random.default_rng(seed).choice(3, p=probs)),) for seed in seeds]

    return draw, asked


async def test_a_plain_mutant_stops_at_the_first_look_that_fails_far_below_the_bound():
    draw, asked = sampler([0.2, 0.3, 0.5])  # far from EXPECTED
    p_value, drawn = await mutant_p_value(draw, EXPECTED, 4000)
    assert p_value < INTERIM_P_VALUE and drawn == 1000 and asked == [range(0, 1000)]


async def test_an_exact_sampler_draws_every_seed_once_and_passes():
    draw, asked = sampler([0.5, 0.3, 0.2])
    p_value, drawn = await mutant_p_value(draw, EXPECTED, 1001, cells=frozenset({(0,), (1,)}))
    assert drawn == 1001 and asked == [range(0, 250), range(250, 500), range(500, 750), range(750, 1001)]
    everything = [outcome for seeds in list(asked) for outcome in await draw(seeds)]
    assert p_value == chi_square_p_value(everything, EXPECTED, frozenset({(0,), (1,)})) > MUTANT_P_VALUE
