"""Per-request speculation figures. Counting lives here; sinks (responses, logs, and later
Prometheus) read the dataclass."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    rounds: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    generated_tokens: int = 0
    reprefills: int = 0
    draft_ms: float = 0.0  # waiting on Propose calls
    target_ms: float = 0.0  # waiting on Verify calls
    draft_compute_ms: float = 0.0  # model work inside the draft service
    target_compute_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)  # index i: rounds accepting draft i
    pipelined: bool = False
    predrafts: int = 0  # continuations started during a verify
    predraft_hits: int = 0  # whole round accepted and the bonus equalled the pre-draft's first token
    predraft_misses: int = 0  # whole round accepted, different bonus token
    predraft_cancelled: int = 0  # a draft token was rejected (or generation ended): cancelled
    predrafted_tokens: int = 0  # tokens of pre-drafts that completed and were read
    predraft_wasted_tokens: int = 0  # of those, tokens discarded (misses)
    predraft_compute_ms: float = 0.0  # draft model work inside read pre-drafts (overlapped)
    k_per_round: list[int] = field(default_factory=list)  # drafts verified per round
    hedges: int = 0  # branches forked for likely rejection outcomes during verifies
    hedge_hits: int = 0  # rounds that ended as a branch assumed, whose drafts were used
    hedged_tokens: int = 0  # drafts taken from hits
    _start: float = field(default_factory=time.perf_counter, repr=False)

    def record_round(self, num_draft: int, num_accepted: int) -> None:
        self.rounds += 1
        self.k_per_round.append(num_draft)
        self.proposed_tokens += num_draft
        self.accepted_tokens += num_accepted
        if num_accepted < num_draft:
            self.recovered_tokens += 1
        else:
            self.bonus_tokens += 1
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self._start) * 1e3

    def mark_first_token(self) -> None:
        if not self.time_to_first_token_ms:
            self.time_to_first_token_ms = self.elapsed_ms()

    def close(self, generated_tokens: int) -> None:
        self.generated_tokens = generated_tokens
        self.total_ms = self.elapsed_ms()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, the recovered/bonus token included (as vLLM counts it)."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0
