"""What the coordinator knows of its draft and target: both services' Info, checked to
form a pair at start-up and read again when a restarted draft refuses a call."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config import CHOOSER_MAX_K, CoordinatorConfig
from coordinator.round_costs import RoundCosts
from specdec.engine.calls import numerics


@dataclass(frozen=True)
class PairInfo:
    """What start-up learned from both services' Info."""

    vocab_size: int  # the target's logit width: ids valid in a request and in the output
    draft_vocab_size: int  # the draft's; may differ (Qwen2.5-0.5B has 151,936 columns, 7B 152,064)
    eos_token_ids: frozenset[int]
    max_context: int  # the target's
    draft_max_context: int
    max_num_speculative_tokens: int  # the largest K a request may ask for: both services' bound
    chooser_max_k: int = CHOOSER_MAX_K  # the largest K the chooser picks (the config's, within the above)
    max_copied_tokens: int = 0  # the longest copy a chosen round may carry, capped by both services'
    costs: RoundCosts | None = None  # measured pass and RPC costs; None when a service did not calibrate
    target_model_id: str = ""  # as the target's Info reports it (the HTTP API's default model name)
    draft_copies: bool = False  # the draft copies by prompt lookup (ModelInfo.copies)
    trees: bool = False  # both services serve token trees (ModelInfo.trees)
    target_numerics: str = ""  # what computes the target's logits (specdec.engine.calls.numerics)
    # A draft with its own tokenizer: the target ids it may propose, one bit each
    # (VocabBridgeInfo.proposable); empty: any id in the vocabulary.
    draft_proposable: bytes = b""
    # An EAGLE-style draft: the target hidden states each verify returns for it (ModelInfo.feature_layers).
    feature_layers: tuple[int, ...] = ()

    @property
    def draft_vocab_limit(self) -> int:
        """ProposeRequest.vocab_limit: the target's width when the draft's logits are wider."""
        return self.vocab_size if self.draft_vocab_size > self.vocab_size else 0

    def for_draft(self, token_ids: list[int]) -> list[int]:
        """Committed tokens as the draft is sent them: an id the draft cannot embed (the
        target's logits are wider) becomes one it can. Exact: the draft's proposals only have
        to come with the distributions they were drawn from, whatever context produced them;
        only their acceptance rate changes."""
        if self.draft_vocab_size >= self.vocab_size:
            return token_ids
        unknown = min(self.eos_token_ids, default=0)
        unknown = unknown if unknown < self.draft_vocab_size else 0
        return [token if token < self.draft_vocab_size else unknown for token in token_ids]


def pair_info(config: CoordinatorConfig, draft_info, target_info, costs: RoundCosts | None) -> PairInfo:
    """What the coordinator knows of the pair, from both services' Info (at start-up, and
    again from the draft's when a restarted draft refuses a call)."""
    services_max = min(draft_info.max_speculative_tokens, target_info.max_speculative_tokens)
    return PairInfo(
        vocab_size=target_info.vocab_size,
        draft_vocab_size=draft_info.vocab_size,
        eos_token_ids=frozenset(target_info.eos_token_ids),
        max_context=target_info.max_context,
        draft_max_context=draft_info.max_context,
        max_num_speculative_tokens=services_max,
        chooser_max_k=min(config.chooser_max_k, services_max),
        max_copied_tokens=min(config.max_copied_tokens, services_max) if draft_info.copies else 0,
        costs=costs,
        target_model_id=target_info.model_id,
        draft_copies=draft_info.copies,
        trees=draft_info.trees and target_info.trees,
        target_numerics=numerics(target_info.dtype, target_info.quantization),
        draft_proposable=draft_info.vocab_bridge.proposable if draft_info.HasField("vocab_bridge") else b"",
        feature_layers=tuple(draft_info.feature_layers),
    )
