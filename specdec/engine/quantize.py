"""int8 weights with per-token activation scales for CPU inference (fbgemm's int8 GEMM).

Why not torch's `quantize_dynamic`: it quantises a pass's activations with ONE scale over
every token in the pass, so a token's logits depend on which other tokens share its pass. A
K + 1-token verify then scores position i differently from a 1-token decode of the same
prefix, and the target's probabilities at position i depend on the drafts after it. Here
every token (row) is scaled to absmax 1 before the int8 GEMM and scaled back after; a fixed
sentinel row pins the tensor's range to [-1, 1], so fbgemm's per-tensor quantiser maps every
row with the same affine map in every pass. Integer accumulation is exact, so each row's
output is bitwise the same whatever else is in the pass (tested), and per-token scales are
also more accurate than per-tensor ones. Cost: at most one extra row per GEMM (the sentinel,
where the engine cannot take the fixed map), a few percent of a pass whose time goes into
reading the weights. Quality: see WEIGHT_LEVELS, and `python -m bench.quality` for perplexity
against float32. Measured cost, memory and quality: docs/design.md, "An int8 target".
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from specdec.engine.fingerprint import tensor_digest

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# fbgemm (x86) or qnnpack (ARM): the int8 GEMM engines torch ships for CPU.
INT8_ENGINES = ("fbgemm", "x86", "qnnpack")
INT8_LABEL = "int8 (per-channel weights, per-token activations)"  # what Info reports as the quantization
# fbgemm's AVX2 kernel multiplies uint8 activations by int8 weights and adds pairs of
# products in int16 (vpmaddubsw), which saturates past 32767. torch's own dynamic
# quantisation avoids that by using 7-bit activations (reduce_range), but halving the
# activations' range costs more perplexity than halving the weights' (each choice measured
# in docs/design.md, "An int8 target"), and 7-bit weights with 8-bit activations cannot
# saturate either (255 · 63 · 2 < 32767), so weights use the range [-63, 63].
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
        qweight = _quantize(weight)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # For the weights fingerprint (specdec.engine.fingerprint): the packed weight is opaque,
        # and unpacking it again would cost ~0.1 s a layer of a 1.5B.
        self.weight_digest = tensor_digest(qweight.int_repr()) + tensor_digest(qweight.q_per_channel_scales())
        self.bias = (
            None
            if linear.bias is None
            else torch.nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
        )
        self.register_buffer("_sentinel", _sentinel_row(self.in_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()  # [M, in]
        absmax = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)  # [M, 1]
        out = _int8_gemm(rows / absmax, self._packed, self._sentinel) * absmax  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _pack(weight: torch.Tensor):  # [out, in] float32 → fbgemm's packed per-channel int8 weight
    return torch.ops.quantized.linear_prepack(_quantize(weight), None)


def _quantize(weight: torch.Tensor) -> torch.Tensor:  # [out, in] float32 → [out, in] qint8, per channel
    scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / WEIGHT_LEVELS).double()  # [out]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates quantized tensors; the ops work
        # |weight / scale| <= WEIGHT_LEVELS by the scale's choice, so no entry rounds past it
        # (tested; a check here cost a second pass over every weight at start-up).
        return torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)


# The affine map fbgemm's dynamic quantiser picks for 8-bit activations spanning exactly [-1, 1].
_ACT_SCALE, _ACT_ZERO_POINT = 2 / 255, 128


def _sentinel_row(in_features: int) -> torch.Tensor:  # [1, in]: pins the quantiser's range to [-1, 1]
    sentinel = torch.zeros(1, in_features)
    sentinel[0, 0], sentinel[0, -1] = 1.0, -1.0
    return sentinel


def _fixed_map_gemm(scaled: torch.Tensor, packed) -> torch.Tensor:  # [M, in] → [M, out]
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        scaled, _ACT_SCALE, _ACT_ZERO_POINT, packed
    )


def _sentinel_gemm(scaled: torch.Tensor, packed, sentinel: torch.Tensor) -> torch.Tensor:  # [M, in] → [M, out]
    # reduce_range=False: 8-bit activations (7-bit weights keep the int16 pair sums in range).
    return torch.ops.quantized.linear_dynamic(torch.cat([sentinel, scaled]), packed, False)[1:]


def _int8_gemm(scaled: torch.Tensor, packed, sentinel: torch.Tensor) -> torch.Tensor:
    """[M, in] rows with entries in [-1, 1] → [M, out], each row quantised with one fixed map.

    Where the engine takes the map as an argument, it is passed; otherwise the sentinel row
    makes the dynamic quantiser pick it (an extra row and a copy: ~25 µs a call on a 0.5B's
    layers, ~5 ms a token over its 169 GEMMs). The two give bitwise the same rows (checked
    once per process, `_fixed_map_available`)."""
    if _fixed_map_available():
        return _fixed_map_gemm(scaled, packed)
    return _sentinel_gemm(scaled, packed, sentinel)


@functools.cache
def _fixed_map_available() -> bool:
    """Whether this build has fbgemm's fixed-map int8 GEMM and it matches the sentinel's rows
    bitwise (measured, not assumed: the fallback is always right)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)  # [out, in]
    rows = torch.randn(5, 40, generator=generator)  # [M, in]
    scaled = rows / rows.abs().amax(dim=1, keepdim=True)
    packed = _pack(weight)
    try:
        fixed = _fixed_map_gemm(scaled, packed)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return torch.equal(fixed, _sentinel_gemm(scaled, packed, _sentinel_row(40)))


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replaces every Linear layer (output head included) by int8 ones, in place.

    Linear layers of one module that read the same input (an attention's q, k and v; an MLP's
    gate and up) become one GEMM over their stacked weights (`SharedInputInt8`). The output
    head is usually tied to the input embeddings; it is untied first so the embeddings keep
    their float rows. CPU and float32 weights only.
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 quantisation runs on CPU only; use --quantize none on a GPU")
    if model.dtype != torch.float32:
        raise ValueError(f"int8 quantisation starts from float32 weights; the model is {model.dtype}")
    if not int8_supported():
        raise ValueError(f"this torch build has no CPU int8 engine (has {torch.backends.quantized.supported_engines})")
    model.config.tie_word_embeddings = False
    _replace_linears(model)
    _own_float_tensors(model)
    return model


def _own_float_tensors(model: torch.nn.Module) -> None:
    """Copies the tensors left in float (embeddings, norms) out of the checkpoint's memory map.

    transformers maps the safetensors file and a loaded tensor is a view of its pages, so a
    single surviving view (the float32 embeddings) keeps the whole file mapped and the pages
    read while loading resident: after int8 quantisation most of a process's memory would be
    the float32 checkpoint it no longer uses. Copying the few float tensors left costs a
    moment at start-up and releases the mapping (the measured RSS: docs/design.md, "An int8
    target"). Identity is kept (`.data` is replaced), so tensors shared between modules stay
    shared.
    """
    copied: dict[tuple, torch.Tensor] = {}  # distinct objects viewing the same memory stay one
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
                if key not in copied:
                    copied[key] = tensor.data.clone()
                tensor.data = copied[key]


# Linear layers that transformers' decoder layers (Llama, Qwen2, Mistral, ...) apply to one input.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInputInt8(torch.nn.Module):
    """One int8 GEMM standing for several Linear layers that read the same input.

    Each of the layers becomes a `SharedInputSlice`; the first to be called with an input
    computes all their outputs at once and the others take their columns. A row's output
    equals what its own RowwiseInt8Linear gives, bitwise: the same per-row activation scale,
    the same per-channel weights, exact integer sums per column (tested). On a 0.5B draft this
    is 72 fewer GEMM calls a token (~35 µs each, mostly per-call cost). A slice called with any
    other tensor recomputes, so a module that feeds its layers different inputs stays right.
    """

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        has_bias = any(lin.bias is not None for lin in linears)
        # skip_init: a random initialisation of the stacked weights, overwritten at once, cost
        # 4.3 s of a 1.5B target's start-up.
        stacked = torch.nn.utils.skip_init(
            torch.nn.Linear, linears[0].in_features, sum(lin.out_features for lin in linears), bias=has_bias
        )
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([lin.weight.detach().float() for lin in linears]))
            if has_bias:
                biases = [torch.zeros(lin.out_features) if lin.bias is None else lin.bias.detach() for lin in linears]
                stacked.bias.copy_(torch.cat(biases))
        self.linear = RowwiseInt8Linear(stacked)
        ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (input, output, slices still to read)

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out_index]
        last = self._last
        if last is None or last[0] is not x:
            last = (x, self.linear(x), len(self.bounds))
        # Drop the held tensors once every slice has read them (a prefill's are megabytes a layer).
        self._last = (last[0], last[1], last[2] - 1) if last[2] > 1 else None
        start, end = self.bounds[index]
        return last[1][..., start:end]


class SharedInputSlice(torch.nn.Module):
    """Stands where one of a SharedInputInt8's Linear layers was."""

    def __init__(self, shared: SharedInputInt8, index: int, in_features: int, out_features: int):
        super().__init__()
        self._shared = (shared,)  # a tuple: the module is registered once, on the parent
        self.index, self.in_features, self.out_features = index, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared[0].columns(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns of a shared int8 GEMM"


def _replace_linears(module: torch.nn.Module) -> None:
    for names in SHARED_INPUT_GROUPS:
        linears = [lin for name in names if isinstance(lin := getattr(module, name, None), torch.nn.Linear)]
        if len(linears) == len(names) and len({lin.in_features for lin in linears}) == 1:
            shared = SharedInputInt8(linears)
            module.add_module("_".join(name.split("_")[0] for name in names) + "_int8", shared)
            for index, (name, lin) in enumerate(zip(names, linears)):
                setattr(module, name, SharedInputSlice(shared, index, lin.in_features, lin.out_features))
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, RowwiseInt8Linear(child))
        elif not isinstance(child, SharedInputInt8):
            _replace_linears(child)
