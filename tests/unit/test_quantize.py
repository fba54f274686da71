"""int8 Linear layers with per-token activation scales: a token's output never depends on
what else is in the pass, which the exactness of an int8 target rests on."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdec.engine import attention, quantize
from specdec.engine.modeling import with_cache
from specdec.engine.quantize import RowwiseInt8Linear, SharedInputInt8, SharedInputSlice, int8_supported, quantize_int8

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
                    model(input_ids=ids[:, i : i + 1], **with_cache(model, cache), use_cache=True).logits[0]
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
            model(input_ids=ids[:, :3], **with_cache(model, cache), use_cache=True)
            if tail_together:
                return model(input_ids=ids_tail, **with_cache(model, cache), use_cache=True).logits[0]
            return torch.cat(
                [
                    model(input_ids=ids_tail[:, i : i + 1], **with_cache(model, cache), use_cache=True).logits[0]
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


def test_layers_that_share_an_input_give_bitwise_their_own_layers_answer():
    """q, k and v (and gate, up) become one GEMM: each slice equals its own int8 layer's output,
    and a slice fed a different tensor recomputes rather than reuse another input's columns."""
    torch.manual_seed(2)
    q, k, v = torch.nn.Linear(48, 32), torch.nn.Linear(48, 16), torch.nn.Linear(48, 16, bias=False)
    shared = SharedInputInt8([q, k, v])
    slices = [SharedInputSlice(shared, i, 48, lin.out_features) for i, lin in enumerate((q, k, v))]
    rows = torch.randn(2, 5, 48) * 3  # [B, T, in]
    for lin, piece in zip((q, k, v), slices):
        assert torch.equal(piece(rows), RowwiseInt8Linear(lin)(rows))
    assert shared._last is None, "the shared output is held until every slice has read it, not after"
    other = torch.randn(2, 5, 48)
    assert torch.equal(slices[0](rows), RowwiseInt8Linear(q)(rows))
    assert torch.equal(slices[1](other), RowwiseInt8Linear(k)(other))  # not rows' columns


def test_a_quantised_decoder_stacks_its_shared_input_layers(tiny_pair):
    model = quantize_int8(AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, SharedInputSlice) and isinstance(layer.mlp.up_proj, SharedInputSlice)
    assert isinstance(layer.self_attn.o_proj, RowwiseInt8Linear) and isinstance(layer.mlp.down_proj, RowwiseInt8Linear)


def test_the_fixed_map_gemm_matches_the_sentinel_path():
    """Where the engine takes the activation map as an argument (skipping a copy a call), its
    rows are bitwise those of the dynamic quantiser with the sentinel row."""
    torch.manual_seed(3)
    layer = RowwiseInt8Linear(torch.nn.Linear(96, 40))
    rows = torch.randn(6, 96) * torch.tensor([0.01, 1, 3, 10, 100, 0.5])[:, None]
    scaled = rows / rows.abs().amax(dim=1, keepdim=True)
    sentinel_path = torch.ops.quantized.linear_dynamic(torch.cat([layer._sentinel, scaled]), layer._packed, False)[1:]
    assert torch.equal(quantize._int8_gemm(scaled, layer._packed, layer._sentinel), sentinel_path)


def _file_mappings(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files ending in `suffix` (Linux)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[-1].endswith(suffix):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_a_quantised_model_keeps_no_view_of_its_checkpoint_file(tiny_pair):
    """The float tensors left after quantisation own their memory: a view of the mapped
    safetensors file would keep the whole float32 checkpoint mapped and resident."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()

    def in_file(model: torch.nn.Module) -> list[str]:
        mapped = _file_mappings(".safetensors")  # read now: freed ranges may be reused
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [name for name, t in tensors if any(start <= t.data_ptr() < end for start, end in mapped)]

    assert in_file(model), "transformers no longer maps the checkpoint: the test would check nothing"
    embeddings = model.get_input_embeddings().weight
    quantize_int8(model)
    assert model.get_input_embeddings().weight is embeddings  # the same Parameter, its memory copied
    assert not in_file(model)


def test_packed_weights_stay_within_the_7_bit_range():
    """Each channel's scale maps its largest weight to WEIGHT_LEVELS, so no entry rounds past
    it, whatever the spread: the AVX2 kernel's int16 pair sums rely on that."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 96, generator=generator) * torch.logspace(-6, 4, 64)[:, None]  # [out, in]
    weight[3] = 0.0  # an all-zero channel
    weight[5, 0] = -weight[5].abs().max() * 10  # one large negative outlier
    scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / quantize.WEIGHT_LEVELS).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = quantize._pack(weight)
        qweight, _ = torch.ops.quantized.linear_unpack(packed)
    assert int(qweight.int_repr().abs().max()) == quantize.WEIGHT_LEVELS
    assert torch.equal(qweight.q_per_channel_scales(), scales)
