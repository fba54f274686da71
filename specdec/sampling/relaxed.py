"""Relaxed acceptance: a lossy opt-in that accepts a draft token the exact rule rejected when the
target ranks it among its likeliest few. Pure functions, no I/O.

Modelled on TensorRT-LLM's relaxed acceptance for DeepSeek's MTP drafts. At draft position i,
draft token d_i is *accepted* when the exact rule accepts it (specdec.sampling.chain), or when

    d_i is among the target's top_n tokens, and raw_prob(d_i) >= raw_prob(top-1) - delta

where raw_prob is the target's next-token distribution before the request's sampling settings:
softmax(logits) at temperature 1. It must be the raw one: a greedy request's target_probs are
one-hot, so they say nothing of the runner-up. The first position that neither rule accepts
ends the round with its recovered token, as in exact mode; a round with no drafts (K = 0, a
target-only step) is the same in both modes.

Relaxed output is NOT distributed as the target's samples (nor, greedy, equal to the target's
greedy output): it trades that guarantee for longer accepted runs. Exact acceptance stays the
default; a request asks for relaxed by name, and every response says which mode produced it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument
from specdec.sampling.probs import MAX_LOGIT_BIAS, SamplingParams
from specdec.sampling.transfer import to_device

# top_n = 1 accepts only the target's argmax (for greedy, what exact accepts already); past 16
# the delta alone decides in practice (the 16th token of a distribution within delta of its
# first is rare), and the top-n search stays a few microseconds a row.
MIN_TOP_N = 1
MAX_TOP_N = 16
# A probability gap: 0 accepts only tokens tied with the top-1, 1 lets the top-n rank decide.
MIN_DELTA = 0.0
MAX_DELTA = 1.0
# Defaults: the target's three likeliest, within 0.3 of the first. A token the target puts
# 0.3 below its first choice is a real alternative, not noise, and a target that is sure
# (top-1 above 0.65 against a runner-up below 0.35) keeps its choice.
DEFAULT_TOP_N = 3
DEFAULT_DELTA = 0.3


class AcceptanceMode(enum.Enum):
    """How a round decides which draft tokens to keep."""

    EXACT = "exact"  # lossless rejection sampling: the output is the target's distribution
    RELAXED = "relaxed"  # exact, or among the target's top-n within delta: lossy

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(mode.value for mode in cls)


@dataclass(frozen=True)
class RelaxedAcceptance:
    """A relaxed request's parameters (see the module docstring)."""

    top_n: int = DEFAULT_TOP_N
    delta: float = DEFAULT_DELTA


def check_relaxed(
    top_n: int, delta: float, top_n_field: str = "relaxed_top_n", delta_field: str = "relaxed_delta"
) -> RelaxedAcceptance:
    """The parameters, or InvalidArgument naming the field (as the caller spells it) and the
    range accepted."""
    if isinstance(top_n, bool) or not MIN_TOP_N <= top_n <= MAX_TOP_N:
        raise InvalidArgument(
            f"{top_n_field} must be an integer in [{MIN_TOP_N}, {MAX_TOP_N}]; got {top_n}", field=top_n_field
        )
    if not (math.isfinite(delta) and MIN_DELTA <= delta <= MAX_DELTA):
        raise InvalidArgument(
            f"{delta_field} must be a probability gap in [{MIN_DELTA:g}, {MAX_DELTA:g}]; got {delta}", field=delta_field
        )
    return RelaxedAcceptance(int(top_n), float(delta))


def relaxed_accepts(
    raw_probs: torch.Tensor,  # [K, V] the target's softmax(logits) at temperature 1, row i predicting d_i
    draft_token_ids: torch.Tensor,  # [K] int64
    top_n: int,
    delta: float,
) -> torch.Tensor:
    """Whether each draft token passes the relaxed test: [K] bool.

    "Among the top n" counts ties in: a token passes when fewer than n tokens are strictly
    likelier, so it never depends on how a sort breaks a tie. A token the target gives no
    mass never passes (as in the exact rule)."""
    if draft_token_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=raw_probs.device)
    top = torch.topk(raw_probs, min(top_n, raw_probs.shape[-1]), dim=-1).values  # [K, n] descending
    draft_token_raw = raw_probs.gather(-1, draft_token_ids[:, None]).squeeze(-1)  # [K]
    among_top_n = draft_token_raw >= top[:, -1]
    within_delta = draft_token_raw >= top[:, 0] - delta
    return among_top_n & within_delta & (draft_token_raw > 0)


def relaxed_verdicts(
    relaxed: RelaxedAcceptance,
    params: SamplingParams,
    logits: torch.Tensor,  # [K + 1, V]: after the request's logit_bias and penalties
    draft_token_ids: torch.Tensor,  # [K] int64
    draft_token_target_probs: torch.Tensor,  # [K]: under the request's own distribution
) -> torch.Tensor:
    """The relaxed test of each draft on the raw distribution: softmax of the logits at
    temperature 1, never the request's processed one (one-hot when greedy). The logits carry
    the request's logit_bias and penalties, and a token it bans (-100, OpenAI's ban) is never
    relaxed in, though in float32 the bias leaves it a little mass (about 1e-44). A sampled
    request's draft must also keep mass under the request's own top-k / top-p, so relaxed
    never emits a token the request's truncation excludes. Every tensor on the logits' device;
    → [K] bool there (the caller fetches it with its outputs)."""
    num_draft = draft_token_ids.shape[0]
    raw_probs = torch.softmax(logits[:num_draft].float(), dim=-1)  # [K, V]
    passes = relaxed_accepts(raw_probs, draft_token_ids, relaxed.top_n, relaxed.delta)
    if not params.greedy:
        passes &= draft_token_target_probs > 0
    if banned := [token for token, value in params.logit_bias if value <= -MAX_LOGIT_BIAS]:
        passes &= ~torch.isin(draft_token_ids, to_device(torch.tensor(banned), raw_probs.device))
    return passes
