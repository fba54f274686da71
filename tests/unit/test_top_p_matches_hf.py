"""Top-k and top-p keep exactly the tokens transformers' warpers keep, so "the target's
distribution" is what `generate(do_sample=True, ...)` samples from even at the boundary: ties,
bf16-rounded logits and Qwen-wide vocabularies included."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams, logits_to_probs


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What generate() samples from: temperature, then top-k, then top-p (its warper order).
    logits: [B, V] float32 → [B, V]"""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def assert_same(logits: torch.Tensor, params: SamplingParams) -> None:
    ours, theirs = logits_to_probs(logits, params), hf_probs(logits, params)
    kept_ours, kept_theirs = ours > 0, theirs > 0
    differing = (kept_ours != kept_theirs).any(dim=-1).nonzero().flatten().tolist()
    assert not differing, f"kept sets differ in rows {differing[:5]} of {logits.shape[0]}"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_ties_at_the_boundary_keep_the_token_transformers_keeps():
    # [0.3, 0.4, 0.3] with top_p = 0.5: transformers keeps the later of the tied tokens.
    logits = torch.log(torch.tensor([[0.3, 0.4, 0.3]]))
    assert_same(logits, SamplingParams(temperature=1.0, top_p=0.5))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert probs[0] == 0 and probs[2] > 0


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.9, 0.95, 0.999])
def test_qwen_wide_float32_logits(top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 151_936, generator=generator) * 3  # [16, V]
    assert_same(logits, SamplingParams(temperature=0.7, top_p=top_p))


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_bf16_rounded_logits_with_many_ties(top_p):
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 151_936, generator=generator) * 4).to(torch.bfloat16).float()  # [16, V], heavy ties
    assert_same(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert_same(logits, SamplingParams(temperature=0.8, top_k=50, top_p=top_p))


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    assert_same(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0] > 0).sum() == 3


def test_float32_request_top_p_is_used_as_sent():
    # The wire carries top_p as float32; the cut uses that value, as generate() would given it.
    top_p = float(torch.tensor(0.9, dtype=torch.float32))
    assert not math.isclose(top_p, 0.9, rel_tol=0, abs_tol=1e-9)
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2))
    assert_same(logits, SamplingParams(temperature=1.0, top_p=top_p))


@pytest.mark.parametrize("top_p", [0.9, 0.95, 0.8, 0.99])
def test_a_top_p_that_crossed_the_wire_cuts_where_transformers_cuts_the_caller_s(top_p):
    """The wire carries top_p as float32, and 1 - float32(0.9) is 3 ulps above transformers'
    1 - 0.9 (0.99: 10 below): a row whose ascending sum lands between them lost, or kept, a
    token generate() keeps (here one with a tenth of the mass). The service reads the float32
    back as the number the caller wrote."""
    at_service = wire.params_from_pb(wire.params_to_pb(SamplingParams(temperature=1.0, top_p=top_p)))
    assert at_service.top_p == top_p
    if top_p == 0.9:  # a row whose least likely token's mass, 0.10000001639 in float32, is between the cuts
        logits = torch.log(torch.tensor([[0.1 + 1.5e-8, 0.3, 0.6 - 1.5e-8]], dtype=torch.float64)).float()
        assert_same(logits, at_service)
        assert logits_to_probs(logits, at_service)[0, 0] > 0.09


def test_float32_rows_are_cut_from_their_sorted_values_without_torchs_sort(monkeypatch):
    """A float32 row whose cut falls between two distinct values is cut from numpy's sort of
    its values (a twentieth of torch's sort with indices over 152k ids): torch's sort is not
    called, and the kept set is still transformers'."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 151_936, generator=generator) * 3  # [4, V]
    expected = hf_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))

    def refused(*args, **kwargs):
        raise AssertionError("torch.sort was called for rows without a tie at the cut")

    monkeypatch.setattr(torch, "sort", refused)
    ours = logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))
    assert torch.equal(ours > 0, expected > 0)
