"""Log-probabilities a verify returns (VerifyRequest.return_logprobs; the OpenAI API's logprobs):
under the raw distribution, log-softmax at temperature 1, before top-k / top-p."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20  # likeliest tokens a position's log-probabilities may list (OpenAI's bound)


def check_top_logprobs(top_logprobs: int, wanted: bool, wanted_name: str = "logprobs") -> int | None:
    """How many likeliest tokens each position's log-probabilities list, None where none are
    wanted; InvalidArgument when out of range, or asked for without `wanted_name`."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]; got {top_logprobs}", field="top_logprobs"
        )
    if top_logprobs and not wanted:
        raise InvalidArgument(f"top_logprobs needs {wanted_name}", field="top_logprobs")
    return top_logprobs if wanted else None


@dataclass(frozen=True)
class PositionLogprobs:
    """Log-probabilities under the raw distribution (log-softmax at temperature 1, before
    top-k / top-p) of the tokens a verify's positions may emit (common.proto TokenLogprobs)."""

    draft: list[float]  # [K]: each draft token's, at the position that predicts it
    rows: list[float]  # [R]: each position's own token's (recovered, bonus, a tree node's next)
    top_ids: list[list[int]]  # [R][n]: the n likeliest tokens at each position, likeliest first
    top: list[list[float]]  # [R][n]

    @classmethod
    def of(cls, fetched: Sequence[torch.Tensor]) -> PositionLogprobs:
        """From `position_logprobs`' tensors, on the host."""
        draft, rows, top_ids, top = (tensor.tolist() for tensor in fetched)
        return cls(draft, rows, top_ids, top)


def position_logprobs(
    logits: torch.Tensor,  # [R, V]: the positions that predict a draft token or the next one
    draft_rows: torch.Tensor,  # [K] int64: the position predicting each draft token (a tree: its parent)
    draft_ids: torch.Tensor,  # [K] int64
    row_ids: torch.Tensor,  # [R] int64: the token each position emits if the round ends there
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tensor on the logits' device, and so the results, for the caller to fetch with its
    outputs (`PositionLogprobs.of`): the draft tokens' [K], each position's own token's [R],
    and the n likeliest [R, n] with their ids [R, n]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    rows = torch.arange(logprobs.shape[0], device=logprobs.device)  # [R]
    draft = logprobs[draft_rows, draft_ids]  # [K]
    own = logprobs[rows, row_ids]  # [R]
    top, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], rows[:, None][:, :0])  # [R, n]
    return draft, own, top_ids, top
