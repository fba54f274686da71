"""The target model side: score the draft tokens in one forward pass and sample what the
coordinator needs for exact rejection sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument
from specdec.probs import SamplingParams, VerifyOutputs, logits_to_probs, verify_outputs
from specdec.runner import ModelRunner, Stopwatch


@dataclass(frozen=True)
class Verification:
    draft_token_target_probs: list[float]  # [K]
    recovered_token_ids: list[int]  # [K]
    bonus_token_id: int
    target_probs: torch.Tensor | None  # [K + 1, V] when asked for
    processed_tokens: int
    sequence_length: int
    compute_ms: float


class TargetRunner(ModelRunner):
    @staticmethod
    def needs_draft_probs(params: SamplingParams, return_distributions: bool) -> bool:
        """False on the greedy fast path, which only compares draft tokens with the argmax;
        callers then need not densify [K, V] draft distributions."""
        return not params.greedy or return_distributions

    def verify(
        self,
        session_id: str,
        keep_tokens: int,
        new_tokens: list[int],
        draft_token_ids: list[int],
        draft_probs: torch.Tensor,  # [K, V] float32 (CPU), from specdec.wire.decode_distributions; unused (any shape) on the greedy fast path
        params: SamplingParams,
        seed: int,
        return_distributions: bool = False,
    ) -> Verification:
        num_draft = len(draft_token_ids)
        if num_draft > self.max_speculative_tokens:
            raise InvalidArgument(
                f"{num_draft} draft tokens exceed the maximum of {self.max_speculative_tokens} per call"
            )
        if not new_tokens:
            raise InvalidArgument("new_tokens is empty; each call must append at least one committed token")
        greedy_fast_path = not self.needs_draft_probs(params, return_distributions)
        if not greedy_fast_path and draft_probs.shape != (num_draft, self.loaded.vocab_size):
            raise InvalidArgument(
                f"draft distributions have shape {tuple(draft_probs.shape)}; expected ({num_draft}, {self.loaded.vocab_size})"
            )
        self.check_tokens(new_tokens, "new_tokens")
        self.check_tokens(draft_token_ids, "draft tokens")
        self.check_length(keep_tokens + len(new_tokens) + num_draft)
        clock = Stopwatch()
        session = self.sessions.open(session_id, keep_tokens)
        pending = session.extend(keep_tokens, new_tokens + draft_token_ids)
        # One pass over every unseen token; only the K + 1 positions that predict a draft
        # token or the bonus token need the (vocab-wide) output head.
        logits = self.forward(session, pending, logits_to_keep=num_draft + 1)  # [K + 1, V]
        draft_ids = torch.tensor(draft_token_ids, dtype=torch.int64)  # [K]
        if greedy_fast_path:
            # The one-hot special case of verify_outputs, without building or sampling one-hots:
            # every residual of a one-hot target is one-hot at the same argmax.
            argmax = logits.argmax(dim=-1).cpu()  # [K + 1]
            outputs = VerifyOutputs((draft_ids == argmax[:num_draft]).float(), argmax[:num_draft], int(argmax[num_draft]))
            target_probs = None
        else:
            target_probs = logits_to_probs(logits, params).cpu()  # [K + 1, V]
            outputs = verify_outputs(target_probs, draft_probs, draft_ids, torch.Generator().manual_seed(seed))
        return Verification(
            draft_token_target_probs=outputs.draft_token_target_probs.tolist(),
            recovered_token_ids=outputs.recovered_token_ids.tolist(),
            bonus_token_id=outputs.bonus_token_id,
            target_probs=target_probs if return_distributions else None,
            processed_tokens=len(pending),
            sequence_length=len(session.tokens),
            compute_ms=clock.ms(),
        )
