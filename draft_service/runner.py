"""The draft model side: propose K tokens autoregressively, each with its exact distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument
from specdec.modeling import LoadedModel
from specdec.probs import SamplingParams, logits_to_probs, one_hot_argmax, sample, truncate_top_k
from specdec.runner import ModelRunner, Stopwatch

PROPOSAL_MODES = ("sample", "greedy")


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # [K]
    probs: torch.Tensor  # [K, V] float32: the distribution each token was drawn from
    deterministic: bool  # every row one-hot at its token
    processed_tokens: int
    sequence_length: int
    compute_ms: float


class DraftRunner(ModelRunner):
    """Proposals follow the request's sampling settings, then the draft's own policy:
    `proposal_mode="greedy"` proposes the draft's argmax (one-hot), `proposal_top_k` truncates.
    Either only changes how often the target accepts, never what the output distribution is,
    because the target sees the exact distribution each token came from."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        session_ttl_s: float,
        max_speculative_tokens: int,
        proposal_mode: str = "sample",
        proposal_top_k: int = 0,
    ):
        super().__init__(loaded, max_sessions, session_ttl_s, max_speculative_tokens)
        if proposal_mode not in PROPOSAL_MODES:
            raise ValueError(f"proposal_mode must be one of {PROPOSAL_MODES}; got {proposal_mode!r}")
        self.proposal_mode = proposal_mode
        self.proposal_top_k = proposal_top_k

    def propose(
        self,
        session_id: str,
        keep_tokens: int,
        new_tokens: list[int],
        num_tokens: int,
        params: SamplingParams,
        seed: int,
    ) -> Proposal:
        if not 1 <= num_tokens <= self.max_speculative_tokens:
            raise InvalidArgument(f"num_tokens must be in [1, {self.max_speculative_tokens}]; got {num_tokens}")
        self.check_tokens(new_tokens, "new_tokens")
        clock = Stopwatch()
        self.check_length(keep_tokens + len(new_tokens) + num_tokens)
        session = self.sessions.open(session_id, keep_tokens)
        pending = session.extend(keep_tokens, new_tokens)
        deterministic = params.greedy or self.proposal_mode == "greedy"
        generator = torch.Generator(device=self.loaded.device).manual_seed(seed)
        processed = 0
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        feed = pending
        for step in range(num_tokens):
            logits = self.forward(session, feed, logits_to_keep=1)[-1]  # [V]
            processed += len(feed)
            if deterministic:
                probs = one_hot_argmax(logits)  # [V]
                token = int(logits.argmax())
            else:
                probs = truncate_top_k(logits_to_probs(logits, params), self.proposal_top_k)  # [V]
                token = int(sample(probs[None], generator)[0])
            token_ids.append(token)
            rows.append(probs)
            session.tokens.append(token)
            feed = [token]
        # The last proposal is in the sequence but not yet in the cache; the next call runs it
        # if it is kept, or crops it away for free if it is not.
        return Proposal(
            token_ids=token_ids,
            probs=torch.stack(rows),
            deterministic=deterministic,
            processed_tokens=processed,
            sequence_length=len(session.tokens),
            compute_ms=clock.ms(),
        )
