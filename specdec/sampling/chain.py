"""The coordinator's side of lossless rejection sampling: pure functions, no I/O.

Draft token d_i, drawn from draft_probs_i, is *accepted* when u_i < target_prob_i / draft_prob_i
with u_i ~ U[0, 1). At the first rejection the target's *recovered* sample for that position
(drawn from norm(max(0, target_probs_i - draft_probs_i))) is emitted and the round ends; if
all K are accepted, the target's *bonus* sample is emitted. This is the Leviathan et al. /
Chen et al. scheme, so the committed tokens are distributed exactly as the target's own samples.
Greedy needs no special case: the target's distribution is one-hot, so the ratio is 0 or ≥ 1.

A relaxed round (specdec.sampling.relaxed, a lossy opt-in) also keeps a token the exact rule
rejects when the target's relaxed test passed for it; its output is then no longer the target's
distribution. Without `relaxed_accepts` every function here is the exact rule alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundOutcome:
    """Result of one speculation round."""

    num_accepted: int  # draft tokens kept, 0..K
    next_token_id: int  # the recovered (num_accepted < K) or bonus (num_accepted == K) token
    relaxed_positions: tuple[int, ...] = ()  # of the kept drafts, those the exact rule rejected (relaxed rounds)

    @property
    def relaxed_accepted(self) -> int:
        return len(self.relaxed_positions)

    def committed(self, draft_token_ids: Sequence[int]) -> list[int]:
        """Tokens this round adds to the sequence: the accepted drafts, then the next token."""
        return [*draft_token_ids[: self.num_accepted], self.next_token_id]

    def is_bonus(self, num_draft: int) -> bool:
        return self.num_accepted == num_draft


def exact_accepts(target_prob: float, draft_prob: float, u: float) -> bool:
    """u < target_prob / draft_prob, written without the division; strict so a token with
    target probability 0 is never accepted."""
    return u * draft_prob < target_prob


def count_accepted(
    draft_token_target_probs: Sequence[float],  # [K]
    draft_token_draft_probs: Sequence[float],  # [K], each > 0 since the draft sampled the token
    uniforms: Sequence[float],  # [K], each in [0, 1)
    relaxed_accepts: Sequence[bool] = (),  # [K] in a relaxed round (VerifyResponse.relaxed_accepts); () exact
) -> int:
    """Length of the accepted prefix of the draft tokens: each accepted by the exact rule, or
    (a relaxed round) by the relaxed test."""
    relaxed = relaxed_accepts or [False] * len(uniforms)
    for i, (target_prob, draft_prob, u, passes) in enumerate(
        zip(draft_token_target_probs, draft_token_draft_probs, uniforms, relaxed, strict=True)
    ):
        if not (exact_accepts(target_prob, draft_prob, u) or passes):
            return i
    return len(uniforms)


def decide_round(
    draft_token_target_probs: Sequence[float],  # [K]
    draft_token_draft_probs: Sequence[float],  # [K]
    uniforms: Sequence[float],  # [K]
    recovered_token_ids: Sequence[int],  # [K]
    bonus_token_id: int,
    relaxed_accepts: Sequence[bool] = (),  # [K] in a relaxed round; () exact
) -> RoundOutcome:
    """Accepted prefix plus the recovered or bonus token that follows it."""
    num_accepted = count_accepted(draft_token_target_probs, draft_token_draft_probs, uniforms, relaxed_accepts)
    relaxed = (
        tuple(
            i
            for i, (target_prob, draft_prob, u) in enumerate(
                zip(draft_token_target_probs[:num_accepted], draft_token_draft_probs[:num_accepted], uniforms)
            )
            if not exact_accepts(target_prob, draft_prob, u)
        )
        if relaxed_accepts
        else ()
    )
    if num_accepted < len(recovered_token_ids):
        return RoundOutcome(num_accepted, int(recovered_token_ids[num_accepted]), relaxed)
    return RoundOutcome(num_accepted, int(bonus_token_id), relaxed)
