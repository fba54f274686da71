"""bench.chooser_sim: the chooser's rate against the best fixed K, simulated."""

from __future__ import annotations

import random

from bench import chooser_sim
from bench.chooser_sim import pair_costs, ratio
from coordinator.adaptive import PROBE_EVERY, AdaptiveK


def test_the_simulated_chooser_nearly_matches_the_best_fixed_k_it_cannot_know():
    cheap_draft = pair_costs("h100-70b-tp4", "h100-1b", rpc_ms=0.8)  # a draft step ~0.1 of a pass
    share, best = ratio(cheap_draft, 0.8, tokens=64, requests=20, seed=0)
    assert best >= 4 and 0.9 < share <= 1.02, (share, best)
    dear_draft = pair_costs("h200-captured-1.5b", "h200-captured-0.5b", rpc_ms=0.8)  # ~0.73
    share, best = ratio(dear_draft, 0.6, tokens=64, requests=20, seed=0)
    assert best == 0 and 0.9 < share <= 1.0, (share, best)


def test_the_simulated_chooser_probes_after_k0_rounds_as_the_coordinators(monkeypatch):
    """Its choices count on the request's own chooser (as commit_round counts them), not on the
    copy that picks within the tokens left: otherwise no K = 0 round counts toward a probe, and
    a simulated request parked at K = 0 never speculates again."""
    made: list[AdaptiveK] = []

    def chooser(**settings) -> AdaptiveK:
        made.append(AdaptiveK(**settings))
        return made[-1]

    monkeypatch.setattr(chooser_sim, "AdaptiveK", chooser)
    chooser_sim.run(pair_costs("h100-8b", "h100-3b", rpc_ms=0.8), 0.05, 512, random.Random(0))
    zeros_in_a_row = "".join("x" if k else "0" for k in made[0].history).split("x")
    assert made[0].zero_streak == len(zeros_in_a_row[-1])
    assert len(made[0].history) > PROBE_EVERY and max(map(len, zeros_in_a_row)) <= PROBE_EVERY
