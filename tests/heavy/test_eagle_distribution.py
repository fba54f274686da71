"""Sampled output through an EAGLE head (issue 68) has the target's distribution: χ² over whole
3-token continuations of the 12-token word pair (tests/heavy/test_distribution.py's method and
bound), with a head in each released layout, one of them fed every feature one position off
(only acceptance may suffer), and a mutant that ships rows other than the ones it drew from,
which must fail."""

from __future__ import annotations

import pytest
import torch

from draft_service import stepping
from specdec.engine.eagle import EAGLE1, EAGLE3
from specdec.engine.features import FeatureTrack
from specdec.tools.testing import build_eagle_head
from tests.heavy.test_distribution import (
    LOCAL_BATCH,
    LOCAL_CONCURRENCY,
    SAMPLES,
    T1,
    exact_target_distribution,
    sample_continuations,
)
from tests.stack import local_stack
from tests.stats import MUTANT_P_VALUE, P_VALUE_FLOOR, chi_square_p_value, mutant_p_value

CASES = {
    "eagle1_sequential": (EAGLE1, {}, False),
    "eagle3_draft_vocab_shifted_features": (EAGLE3, {}, True),
}


async def eagle_samples(word_pair, head, coordinator: dict, seeds: range = range(SAMPLES)) -> tuple[list, list]:
    draft = {
        **LOCAL_BATCH,
        "model": str(word_pair.target),
        "drafter": "eagle",
        "draft_head": str(head),
        "quantize": "none",
    }
    async with local_stack(
        word_pair, draft_overrides=draft, coordinator_overrides=coordinator, target_overrides=LOCAL_BATCH
    ) as stack:
        stats: list = []
        samples = await sample_continuations(stack.stub, T1, seeds, stats=stats, concurrency=LOCAL_CONCURRENCY)
        assert stack.draft_runner.received_feature_rows > len(seeds) // 2, (
            "the head was rarely sent the target's features"
        )
        assert stack.draft_runner.batched_forwards > 0, "no pass of the head was shared between sessions"
    return samples, stats


@pytest.mark.parametrize("case", sorted(CASES))
async def test_eagle_output_has_the_target_distribution(word_pair, tmp_path, monkeypatch, case):
    kind, coordinator, shifted = CASES[case]
    head = build_eagle_head(tmp_path / kind, word_pair.target, kind, draft_vocab=8 if kind == EAGLE3 else 0)
    if shifted:  # every target row stored one position late: the wrong features, still exact
        receive = FeatureTrack.receive
        monkeypatch.setattr(FeatureTrack, "receive", lambda track, start, rows: receive(track, start + 1, rows))
    samples, stats = await eagle_samples(word_pair, head, coordinator)
    assert sum(s.accepted_tokens for s in stats) > SAMPLES // 4, "the head's drafts were rarely accepted"
    expected = exact_target_distribution(word_pair.target, T1, word_pair.vocab_size)
    p_value = chi_square_p_value(samples, expected)
    assert p_value > P_VALUE_FLOOR, f"{case}: χ² p-value {p_value:.2e}; output is not the target's distribution"


async def test_a_head_shipping_rows_it_did_not_draw_from_fails(word_pair, tmp_path, monkeypatch):
    """Mutant: each token drawn from the head's distribution, but shipped with a uniform row
    over the vocabulary: the target's acceptance test then reads the wrong q, and the output
    must fail the same bound. (A one-hot row at the drawn token would not do: any proposal
    shipped one-hot is exact, as prompt lookup's are.)"""
    take = stepping.DraftStepper._take

    def sharpened(self, drafting, row, drawn_prob, runner_ups, head_probs, support, batch_size):
        shipped = torch.full_like(head_probs, 1.0 / head_probs.numel())
        take(self, drafting, row, drawn_prob, runner_ups, shipped, None, batch_size)

    monkeypatch.setattr(stepping.DraftStepper, "_take", sharpened)
    head = build_eagle_head(tmp_path / EAGLE1, word_pair.target, EAGLE1)
    expected = exact_target_distribution(word_pair.target, T1, word_pair.vocab_size)

    async def draw(seeds: range) -> list[tuple[int, ...]]:
        return (await eagle_samples(word_pair, head, {}, seeds))[0]

    p_value, _ = await mutant_p_value(draw, expected, SAMPLES)
    assert p_value < MUTANT_P_VALUE
