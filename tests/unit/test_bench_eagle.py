"""bench.eagle's summary: ratios are geometric means over repeats of the same prompt, and
accepted lengths count drafted rounds only."""

from __future__ import annotations

import pytest

from bench.eagle import summarise


def sample(run: str, repeat: int, tok_s: float, accepted: int = 0, drafted: int = 0, kind: str = "code") -> dict:
    return {
        "run": run,
        "repeat": repeat,
        "kind": kind,
        "temperature": 0.0,
        "tokens": 100,
        "total_ms": 100 / tok_s * 1e3,
        "accepted": accepted,
        "drafted_rounds": drafted,
        "token_ids": [1, 2, 3],
    }


def test_ratios_are_geometric_means_over_repeats():
    samples = []
    for repeat, (base, draft, head) in enumerate([(10, 12, 20), (10, 12, 5)]):
        samples += [sample("target-only", repeat, base), sample("0.5B draft", repeat, draft, 6, 3)]
        samples += [sample("hybrid", repeat, 16, 8, 2), sample("prompt lookup", repeat, 11, 2, 2)]
        samples += [sample("eagle head", repeat, head, 9, 3)]
    for kind in ("explanation",):
        samples += [sample(run, 0, 10, kind=kind) for run in ("target-only", "0.5B draft", "eagle head")]
    row = summarise({"samples": samples})["code T=0.0"]
    assert row["eagle head / target-only"] == pytest.approx(1.0)  # sqrt(2.0 · 0.5)
    assert row["0.5B draft / target-only"] == pytest.approx(1.2)
    assert row["hybrid / target-only"] == pytest.approx(1.6) and row["prompt lookup / target-only"] == pytest.approx(
        1.1
    )
    assert row["head / hybrid"] == pytest.approx(10 / 16)
    assert row["head / 0.5B draft"] == pytest.approx(10 / 12, abs=1e-3)
    assert row["accepted per drafted round, eagle head"] == 3.0 and row["accepted per drafted round, 0.5B draft"] == 2.0
    assert row["accepted per drafted round, hybrid"] == 4.0 and row["accepted per drafted round, prompt lookup"] == 1.0
    assert row["greedy identical"]


def test_a_run_without_some_drafters_reports_the_ones_it_has():
    """Results written before the hybrid and prompt lookup had stacks of their own summarise too."""
    samples = [sample("target-only", 0, 10), sample("0.5B draft", 0, 12, 4, 2), sample("eagle head", 0, 15, 3, 3)]
    row = summarise({"samples": samples})["code T=0.0"]
    assert set(row) == {
        "0.5B draft / target-only",
        "eagle head / target-only",
        "head / 0.5B draft",
        "accepted per drafted round, 0.5B draft",
        "accepted per drafted round, eagle head",
        "greedy identical",
    }
