"""A model's hidden features, as an EAGLE-style draft head reads them (issue 68).

The numbering is transformers' `hidden_states`: 0 is the embeddings' output, i (0 < i < L)
the output of decoder layer i - 1 (the input of layer i), L the final norm's output, for a
model of L decoder layers. EAGLE-1 reads L; EAGLE-3 fuses a low, a middle and a high layer
(2, L // 2, L - 3 in its releases).

`FeatureTap` records them with forward hooks while a runner's passes run: the hooks copy
what the layers already compute, so a pass with the tap gives bitwise the logits of one
without it. `FeatureTrack` holds one draft session's features by position, as the head's passes
read them (specdec.engine.eagle).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

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


@dataclass
class FeatureTrack:
    """One session's features by position, as the head's passes read them: the target's where
    they were sent, the head's own predictions elsewhere. Rows are H wide (an EAGLE-3 target
    row already through `fc`). Positions below `base` were dropped: every cache slot that read
    them was computed from the target's features (`kv_exact`), so none is read again."""

    width: int
    base: int = 0
    target: list[torch.Tensor | None] = field(default_factory=list)  # position base + i → [H] or None
    predicted: list[torch.Tensor | None] = field(default_factory=list)
    kv_exact: int = 0  # leading cache slots whose pass read the target's feature (or slot 0's zeros)

    def fork(self, keep_tokens: int) -> FeatureTrack:
        track = FeatureTrack(self.width, self.base, list(self.target), list(self.predicted), self.kv_exact)
        track.rollback(keep_tokens)
        return track

    def rollback(self, keep_tokens: int) -> None:
        """The sequence keeps its first `keep_tokens` tokens: features of later positions go,
        and so do the cache slots past them."""
        end = max(keep_tokens - self.base, 0)
        del self.target[end:]
        del self.predicted[end:]
        self.kv_exact = min(self.kv_exact, keep_tokens)
        if keep_tokens <= self.base:  # back past the positions dropped (a re-send from 0): start over
            self.base = 0

    def receive(self, start: int, rows: torch.Tensor) -> None:
        """The target's features of positions start .. start + N - 1. rows: [N, H]"""
        for offset in range(rows.shape[0]):
            index = start + offset - self.base
            if index < 0:
                continue
            self._grow(index + 1)
            self.target[index] = rows[offset]

    def has_target(self, position: int) -> bool:
        index = position - self.base
        return position < 0 or 0 <= index < len(self.target) and self.target[index] is not None

    def runnable(self, start: int, tokens: int, short_tail: int) -> int:
        """How many of `tokens` tokens, from cache slot `start` on, one pass may run: a slot
        reads the slot before's output unless the target's feature for it is here, except in a
        long run (more than `short_tail` tokens left: a prompt before its first verify), which
        reads zeros where it has nothing better, in one pass."""
        count = 1
        while count < tokens and (self.has_target(start + count - 1) or tokens - count > short_tail):
            count += 1
        return count

    def stale_from(self, cached: int) -> int | None:
        """The first cache slot to compute again now that the target's features reached it:
        the first inexact slot, when its input has now come; None when none needs to."""
        if self.kv_exact < cached and self.has_target(self.kv_exact - 1):
            return self.kv_exact
        return None

    def inputs(self, positions: list[int], like: torch.Tensor) -> torch.Tensor:
        """The feature each slot's pass reads: that of the position before it. → [N, H]"""
        rows = []
        for position in positions:
            row = self._row(position - 1)
            rows.append(torch.zeros(self.width, dtype=like.dtype, device=like.device) if row is None else row.to(like))
        return torch.stack(rows)

    def record(self, positions: list[int], outputs: torch.Tensor) -> None:
        """The head's predictions for `positions` (outputs [N, H]), and which slots read the
        target's features: the leading run of them extends `kv_exact`."""
        for position, row in zip(positions, outputs):
            index = position - self.base
            if index >= 0:
                self._grow(index + 1)
                self.predicted[index] = row.detach()
        for position in positions:
            if position == self.kv_exact and self.has_target(position - 1):
                self.kv_exact += 1
        self._trim()

    def _row(self, position: int) -> torch.Tensor | None:
        index = position - self.base
        if position < 0 or index < 0 or index >= len(self.target):
            return None
        target = self.target[index]
        return target if target is not None else self.predicted[index]

    def _grow(self, length: int) -> None:
        while len(self.target) < length:
            self.target.append(None)
            self.predicted.append(None)

    def _trim(self) -> None:
        """Drops positions no slot will read again: those before the last exact slot's input."""
        drop = min(self.kv_exact - 1 - self.base, len(self.target))
        if drop > 0:
            del self.target[:drop]
            del self.predicted[:drop]
            self.base += drop


def joined_features(first: torch.Tensor | None, steps: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The features of a call and of its target-only steps after it, in order: [N, F] (None without)."""
    if first is None:
        return None
    return torch.cat([first, *(step for step in steps if step is not None)])
