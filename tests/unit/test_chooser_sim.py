"""bench.chooser_sim: the chooser's rate against the best fixed K, simulated."""

from __future__ import annotations

from bench.chooser_sim import pair_costs, ratio


def test_the_simulated_chooser_nearly_matches_the_best_fixed_k_it_cannot_know():
    cheap_draft = pair_costs("h100-70b-tp4", "h100-1b", rpc_ms=0.8)  # a draft step ~0.1 of a pass
    share, best = ratio(cheap_draft, 0.8, tokens=64, requests=20, seed=0)
    assert best >= 4 and 0.9 < share <= 1.02, (share, best)
    dear_draft = pair_costs("h200-captured-1.5b", "h200-captured-0.5b", rpc_ms=0.8)  # ~0.73
    share, best = ratio(dear_draft, 0.6, tokens=64, requests=20, seed=0)
    assert best == 0 and 0.9 < share <= 1.0, (share, best)
