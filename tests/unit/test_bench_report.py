"""The benchmark's derived figures: per-token α and Leviathan's theoretical speedup."""

from __future__ import annotations

import pytest

from bench.report import summarise, theoretical_speedup


def test_theoretical_speedup_formula():
    assert theoretical_speedup(0.8, 0, 0.4) == 1.0
    assert theoretical_speedup(0.8, 2, 0.5) == pytest.approx((1 - 0.8**3) / (0.2 * 2.0))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0


def _sample(mode, rounds, proposed, accepted, per_position, total_ms=1000.0, draft=100.0, target=800.0):
    return dict(mode=mode, kind="code", temperature=0.0, repeat=0, tokens=accepted + rounds, total_ms=total_ms, ttft_ms=10.0,
                rounds=rounds, proposed=proposed, accepted=accepted, accepted_per_position=per_position,
                draft_compute_ms=draft, target_compute_ms=target)


def test_alpha_counts_only_positions_that_were_evaluated():
    results = {
        "modes": [dict(name="ours target-only (K=0)", family="ours", k=0, assisted=None), dict(name="ours K=2", family="ours", k=2, assisted=None)],
        "samples": [
            _sample("ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0, target=2000.0),
            # 10 rounds of K=2: 8 accepted position 0, 4 of those also position 1.
            _sample("ours K=2", rounds=10, proposed=20, accepted=12, per_position=[8, 4]),
        ],
    }
    row = {r["mode"]: r for r in summarise(results)[0.0]}["ours K=2"]
    assert row["acceptance"] == pytest.approx(12 / 20)
    assert row["alpha"] == pytest.approx(12 / (10 + 8))  # positions reached: 10 at i=0, 8 at i=1
    assert row["per_position_acceptance"] == [0.8, 0.4]
    c = (100.0 / 20) / (2000.0 / 20)
    assert row["cost_ratio_c"] == pytest.approx(c)
    assert row["theoretical_speedup"] == pytest.approx(theoretical_speedup(12 / 18, 2, c))
