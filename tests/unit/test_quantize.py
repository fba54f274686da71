"""int8 Linear layers with per-token activation scales: a token's output never depends on
what else is in the pass, which the exactness of an int8 target rests on."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdec import attention
from specdec.quantize import RowwiseInt8Linear, int8_supported, quantize_int8

pytestmark = pytest.mark.skipif(not int8_supported(), reason="this torch build has no CPU int8 engine")


def test_each_row_is_the_same_whatever_shares_its_pass():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    layer = RowwiseInt8Linear(linear)
    rows = torch.randn(7, 64) * torch.tensor([0.01, 1, 3, 10, 100, 0.5, 7.0])[:, None]  # [7, 64], very different scales
    together = layer(rows)  # [7, 96]
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(7)])
    assert torch.equal(together, alone)  # bitwise, not merely close
    assert torch.equal(layer(rows[None])[0], together)  # [1, 7, 64] inputs too


def test_per_token_scales_are_closer_to_float32_than_torch_dynamic_quantisation():
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 512)
    rows = torch.randn(5, 256) * torch.tensor([0.1, 1.0, 10.0, 1.0, 0.1])[:, None]
    exact = linear(rows)
    ours = RowwiseInt8Linear(linear)(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8
        )(rows)
    relative = ((ours - exact).norm(dim=1) / exact.norm(dim=1)).max()
    assert relative < 0.02
    # torch's one scale per pass crushes the small rows; per-token scales do not.
    assert relative < ((dynamic - exact).norm(dim=1) / exact.norm(dim=1)).max()


def test_a_k_plus_one_token_pass_scores_like_one_token_passes(tiny_pair):
    """The int8 target's verify of K + 1 tokens gives the logits one-token decoding gives,
    up to float32 rounding in attention (dynamic per-pass scales fail this by far more)."""
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 8, 61]])  # [1, 8]

    def pass_vs_steps(model) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            together = model(input_ids=ids).logits[0]  # [8, V]
            cache = DynamicCache(config=model.config)
            one_by_one = torch.cat(
                [
                    model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0]
                    for i in range(ids.shape[1])
                ]
            )
        return together, one_by_one

    model = quantize_int8(AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval())
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    together, one_by_one = pass_vs_steps(model)
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-4)
    # With per-row attention as well (as the target service runs on CPU), bitwise equal.
    model.set_attn_implementation(attention.NAME)
    ids_tail = ids[:, 3:]

    def prefix_then(model, tail_together: bool) -> torch.Tensor:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
            if tail_together:
                return model(input_ids=ids_tail, past_key_values=cache, use_cache=True).logits[0]
            return torch.cat(
                [
                    model(input_ids=ids_tail[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0]
                    for i in range(ids_tail.shape[1])
                ]
            )

    assert torch.equal(prefix_then(model, True), prefix_then(model, False))
    # Power: torch's per-pass activation scale gives a different answer for the same token.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(
            AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval(),
            {torch.nn.Linear},
            dtype=torch.qint8,
        )
    together, one_by_one = pass_vs_steps(dynamic)
    assert (together - one_by_one).abs().max() > 1e-2


def test_refuses_what_it_cannot_quantise(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(model)


def test_extreme_activations_and_weights_do_not_saturate_the_int8_kernel():
    """Every activation at its row's maximum against every weight at its channel's maximum:
    the largest products the kernel can see. fbgemm's AVX2 path adds product pairs in int16;
    with 8-bit weights and 8-bit activations these would saturate and the sum come out wrong."""
    linear = torch.nn.Linear(512, 4, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
        linear.weight[1].fill_(-0.5)
    rows = torch.full((3, 512), 2.0)
    rows[1] = -2.0
    torch.testing.assert_close(RowwiseInt8Linear(linear)(rows), linear(rows), rtol=1e-2, atol=1e-2)
