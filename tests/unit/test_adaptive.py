"""Adaptive K: Leviathan's expected tokens over a fitted round time, pure functions."""

from __future__ import annotations

import pytest

from coordinator.adaptive import AdaptiveK, LinearCost, best_k, expected_tokens


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_k_grows_with_acceptance_and_with_cheaper_drafts():
    verify = LinearCost(fixed=200.0, per_token=0.0)
    cheap, dear = LinearCost(fixed=2.0, per_token=10.0), LinearCost(fixed=2.0, per_token=80.0)
    assert best_k(0.95, cheap, verify, 8, pipelined=False) == 8
    assert best_k(0.3, dear, verify, 8, pipelined=False) == 1
    assert best_k(0.8, cheap, verify, 8, False) > best_k(0.8, dear, verify, 8, False)
    # Pipelining hides part of the draft, so it never wants fewer drafts.
    assert best_k(0.8, dear, verify, 8, pipelined=True) >= best_k(0.8, dear, verify, 8, pipelined=False)


def test_linear_cost_separates_fixed_and_per_token_once_k_varies():
    cost = LinearCost(fixed=1.0, per_token=1.0)
    for _ in range(3):
        for n in (1, 2, 3, 4):
            cost.observe(n, 30.0 + 40.0 * n)
    assert cost.fixed == pytest.approx(30.0, rel=1e-6) and cost.per_token == pytest.approx(40.0, rel=1e-6)
    single = LinearCost(fixed=10.0, per_token=10.0)
    single.observe(3, 80.0)  # one K only: keeps the prior's split, matches the total
    assert single.at(3) == pytest.approx(80.0) and single.fixed == pytest.approx(20.0)


def test_adaptive_k_learns_acceptance_and_explores():
    chooser = AdaptiveK(k_max=8, pipelined=False, draft=LinearCost(2.0, 20.0), verify=LinearCost(200.0, 0.0), accepted=1.5, reached=2.0)
    for _ in range(30):
        chooser.observe_round(proposed=4, accepted=0)  # every first draft rejected
    assert chooser.alpha < 0.1
    ks = [chooser.choose() for _ in range(16)]
    assert ks.count(1) == 14 and ks[7] == ks[15] == 2, "every 8th round tries one K more"
    chooser.observe_round(proposed=4, accepted=4)
    assert chooser.reached == 2.0 + 30 + 4
