"""A model's hidden features, as an EAGLE-style draft head reads them (issue 68).

The numbering is transformers' `hidden_states`: 0 is the embeddings' output, i (0 < i < L)
the output of decoder layer i - 1 (the input of layer i), L the final norm's output, for a
model of L decoder layers. EAGLE-1 reads L; EAGLE-3 fuses a low, a middle and a high layer
(2, L // 2, L - 3 in its releases).

`FeatureTap` records them with forward hooks while a runner's passes run: the hooks copy
what the layers already compute, so a pass with the tap gives bitwise the logits of one
without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from specdec.errors import InvalidArgument

FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_FEATURE_DTYPE = "bfloat16"


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, Sequence[torch.nn.Module], torch.nn.Module]:
    """(embeddings, decoder layers, final norm) of a transformers causal LM (Llama, Qwen2,
    Mistral and the like: `model.model.{embed_tokens,layers,norm}`)."""
    body = getattr(model, "model", None)
    parts = [getattr(body, name, None) for name in ("embed_tokens", "layers", "norm")]
    if any(part is None for part in parts):
        raise ValueError(
            f"{type(model).__name__} has no model.embed_tokens / model.layers / model.norm to read features from"
        )
    return parts[0], parts[1], parts[2]  # type: ignore[return-value]


def check_feature_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`layers` as asked (VerifyRequest.feature_layers), after checking each is in [0, L]."""
    for layer in layers:
        if not 0 <= layer <= num_layers:
            raise InvalidArgument(
                f"feature layer {layer} is outside [0, {num_layers}] (hidden_states of a model of {num_layers} layers)"
            )
    if len(set(layers)) != len(layers):
        raise InvalidArgument(f"feature_layers {list(layers)} name a layer twice")
    return tuple(layers)


def feature_dtype(name: str) -> torch.dtype:
    """VerifyRequest.feature_dtype → its torch dtype ("" is the default, bfloat16)."""
    try:
        return FEATURE_DTYPES[name or DEFAULT_FEATURE_DTYPE]
    except KeyError:
        raise InvalidArgument(f"feature_dtype {name!r} is not one of {sorted(FEATURE_DTYPES)}") from None


class FeatureTap:
    """Records the hidden states `layers` of each pass a model runs inside `recording()`:
    `rows()` is then [N, len(layers) · H], one row per token the passes ran, in order."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]) -> None:
        embeddings, decoder_layers, norm = decoder_parts(model)
        self.layers = check_feature_layers(layers, len(decoder_layers))
        modules = {0: embeddings, len(decoder_layers): norm}
        self._modules = [modules.get(layer) or decoder_layers[layer - 1] for layer in self.layers]
        self._first = self.layers.index(min(self.layers))  # the slot a pass reaches first
        self._passes: list[list[torch.Tensor | None]] = []

    @contextmanager
    def recording(self) -> Iterator[FeatureTap]:
        self._passes = []
        hooks = [module.register_forward_hook(self._hook(slot)) for slot, module in enumerate(self._modules)]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def _hook(self, slot: int):
        def record(module, args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output  # [1, N, H]
            if slot == self._first:
                self._passes.append([None] * len(self._modules))
            self._passes[-1][slot] = hidden[0].detach()

        return record

    def rows(self) -> torch.Tensor:
        """[N, len(layers) · H] over every pass recorded, in their order (float32)."""
        chunks = []
        for layers in self._passes:
            if any(hidden is None for hidden in layers):
                raise AssertionError("a pass ran some of the tapped layers and not others")
            chunks.append(torch.cat([hidden.float() for hidden in layers], dim=-1))  # type: ignore[union-attr]
        return torch.cat(chunks) if chunks else torch.empty(0, 0)
