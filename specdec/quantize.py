"""int8 weights with per-token activation scales for CPU inference (fbgemm's int8 GEMM).

Why not torch's `quantize_dynamic`: it quantises a pass's activations with ONE scale over
every token in the pass, so a token's logits depend on which other tokens share its pass. A
K + 1-token verify then scores position i differently from a 1-token decode of the same
prefix, and the target's probabilities at position i depend on the drafts after it. Here
every token (row) is scaled to absmax 1 before the int8 GEMM and scaled back after; a fixed
sentinel row pins the tensor's range to [-1, 1], so fbgemm's per-tensor quantiser maps every
row with the same affine map in every pass. Integer accumulation is exact, so each row's
output is bitwise the same whatever else is in the pass (tested), and per-token scales are
also more accurate than per-tensor ones. Cost: one extra row per GEMM (measured on the 1.5B
target, 2 threads, AVX2: 115 ms per 1-token pass against 111 ms for `quantize_dynamic`).
Quality: see WEIGHT_LEVELS, and `python -m bench.quality` for perplexity against float32.
"""

from __future__ import annotations

import warnings

import torch
from transformers import PreTrainedModel

# fbgemm (x86) or qnnpack (ARM): the int8 GEMM engines torch ships for CPU.
INT8_ENGINES = ("fbgemm", "x86", "qnnpack")
INT8_LABEL = "int8 (per-channel weights, per-token activations)"  # what Info reports as the dtype
# fbgemm's AVX2 kernel multiplies uint8 activations by int8 weights and adds pairs of
# products in int16 (vpmaddubsw), which saturates past 32767. torch's own dynamic
# quantisation avoids that by using 7-bit activations (reduce_range); measured on the 1.5B
# target, that costs 3.6% perplexity, 7-bit weights with 8-bit activations 1.6% (255 · 63 · 2
# < 32767, so no pair can saturate), so weights use the range [-63, 63].
WEIGHT_LEVELS = 63


def int8_supported() -> bool:
    """Whether this torch build has a CPU int8 GEMM engine."""
    return bool(set(torch.backends.quantized.supported_engines) & set(INT8_ENGINES))


class RowwiseInt8Linear(torch.nn.Module):
    """A Linear layer with symmetric per-output-channel int8 weights and per-token int8
    activations; float32 in, float32 out."""

    _sentinel: torch.Tensor  # a buffer: [1, in]

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.out_features, self.in_features = weight.shape
        scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / WEIGHT_LEVELS).double()  # [out]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 deprecates quantized tensors; the ops work
            qweight = torch.quantize_per_channel(
                weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8
            )
            assert int(qweight.int_repr().abs().max()) <= WEIGHT_LEVELS
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = (
            None
            if linear.bias is None
            else torch.nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
        )
        sentinel = torch.zeros(1, self.in_features)  # [1, in]: pins the quantiser's range to [-1, 1]
        sentinel[0, 0], sentinel[0, -1] = 1.0, -1.0
        self.register_buffer("_sentinel", sentinel, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()  # [M, in]
        absmax = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)  # [M, 1]
        scaled = torch.cat([self._sentinel, rows / absmax])  # [M + 1, in], every entry in [-1, 1]
        # reduce_range=False: 8-bit activations (7-bit weights keep the int16 pair sums in range).
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, False)[1:] * absmax  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replaces every Linear layer (output head included) by a RowwiseInt8Linear, in place.

    The output head is usually tied to the input embeddings; it is untied first so the
    embeddings keep their float rows. CPU and float32 weights only.
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 quantisation runs on CPU only; use --quantize none on a GPU")
    if model.dtype != torch.float32:
        raise ValueError(f"int8 quantisation starts from float32 weights; the model is {model.dtype}")
    if not int8_supported():
        raise ValueError(f"this torch build has no CPU int8 engine (has {torch.backends.quantized.supported_engines})")
    model.config.tie_word_embeddings = False
    _replace_linears(model)
    return model


def _replace_linears(module: torch.nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, RowwiseInt8Linear(child))
        else:
            _replace_linears(child)
