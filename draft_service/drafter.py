"""What the draft servicer needs from a drafter, whichever kind: the model drafter
(draft_service.runner) and the prompt-lookup drafter (draft_service.ngram) both provide it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.engine.calls import ModelDescription
from specdec.engine.sessions import SessionStore
from specdec.errors import InvalidArgument
from specdec.sampling.probs import RowSupport, SamplingParams


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # [K'], K' <= K: a drafter may propose fewer, even none
    probs: torch.Tensor | None  # [K', V] float32: the distribution each token was drawn from;
    # None when deterministic (every row one-hot at its token)
    deterministic: bool
    processed_tokens: int
    sequence_length: int
    compute_ms: float
    # Per position, the draft's likeliest other tokens (ProposeCall.runner_ups of them, best
    # first) and their draft probabilities: where a hedge would guess the recovered token.
    # Empty when the drafter has no distribution.
    runner_up_ids: list[int] = field(default_factory=list)  # [K' · R], position after position
    runner_up_probs: list[float] = field(default_factory=list)  # [K' · R]
    batch_size: int = 1  # most sessions that shared one of its forward passes
    # Per row, the ids of exactly its non-zero entries when the drafter knows them without a
    # scan (top-k truncation); None rows, or no list, are found by the wire encoder.
    supports: list[RowSupport | None] | None = None
    copied: bool = False  # copied by prompt lookup (one-hot rows, no forward pass)
    parents: list[int] = field(default_factory=list)  # [K']: a token tree's parent nodes; empty: a chain


@dataclass(frozen=True)
class ProposeCall:
    """One Propose request, runner-side."""

    session_id: str
    keep_tokens: int
    new_tokens: list[int]
    num_tokens: int  # K
    params: SamplingParams
    seed: int
    epoch: int = 0
    should_stop: Callable[[], bool] = lambda: False  # polled between steps (the caller cancelled)
    fork_from: str = ""
    min_confidence: float | None = None  # None: the runner's default; 0: never stop early
    vocab_limit: int = 0  # propose only ids below this (the target's width); 0: no limit
    max_copied_tokens: int | None = None  # a copying drafter copies at most this many (None: num_tokens)
    tree_widths: tuple[int, ...] = ()  # propose a tree: children per node at each depth (num_tokens 0)
    guess_first: bool = False  # the first token is the argmax, a guess (ProposeRequest.guess_first)
    cache_namespace: str = ""  # whose earlier text the session may reuse (ProposeRequest.cache_namespace)
    own_sequence_only: bool = False  # copy from the session's own sequence alone (ProposeRequest)
    runner_ups: int = 1  # the likeliest other tokens to report per position (ProposeRequest.runner_ups)
    guess_rank: int = 0  # with guess_first, guess the draft's (rank + 1)-th likeliest token (ProposeRequest)
    # ProposeRequest.features: (first position, [N, F] float32 rows) of the target's features; None: none sent
    features: tuple[int, torch.Tensor] | None = None

    @property
    def copy_limit(self) -> int:
        """The most tokens a copy may carry (0: none)."""
        return self.num_tokens if self.max_copied_tokens is None else self.max_copied_tokens


class Drafter(Protocol):
    """Proposes tokens per session and keeps each session's sequence between calls.

    `shares_passes`: whether calls from several sessions run cheaper together than apart (a
    model's forward pass), which is when the servicer batches them; a lookup has nothing to share.
    """

    shares_passes: bool
    sessions: SessionStore
    max_speculative_tokens: int

    def propose_one(self, call: ProposeCall) -> Proposal: ...

    def propose_batch(
        self,
        calls: list[ProposeCall],
        answer: Callable[[int, Proposal | Exception], None] | None = None,
        join: Callable[[int], list[ProposeCall]] | None = None,
    ) -> list[Proposal | Exception]: ...

    def describe(self) -> ModelDescription: ...

    def end_session(self, session_id: str, keep: bool = True) -> bool: ...

    def expire_sessions(self) -> int: ...


def stops_on_confidence(drawn_prob: float, min_confidence: float, runner_up_guess: bool = False) -> bool:
    """Whether a proposal ends after a token the draft drew with probability `drawn_prob`
    (its belief in its own argmax when greedy). The token itself is still proposed: the
    decision looks only at draws already made (see DraftRunner._done).

    A `runner_up_guess` (a fork's first token, a runner-up guessed for the bonus token:
    ProposeRequest.guess_rank > 0) never stops it: a runner-up is below 0.5 by definition and
    nearly always below the default 0.4, so such forks would end at their guess, with no draft
    past it to keep. Whether it is right is the target's bonus sample's to decide; the drafts
    after it stop on their own confidence."""
    return drawn_prob < min_confidence and not runner_up_guess


def check_confidence(min_confidence: float) -> float:
    if not 0.0 <= min_confidence <= 1.0:  # NaN fails too
        raise InvalidArgument(f"min_confidence must be in [0, 1] (0 = never stop early); got {min_confidence}")
    return min_confidence
