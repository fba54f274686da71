"""Choosing K each round from running estimates of acceptance and of draft and verify time.

Leviathan et al.: with per-token acceptance α, a round of K drafts commits on average
E(K) = (1 − α^(K+1)) / (1 − α) tokens. A sequential round costs T(K) = D(K) + V(K), the draft
call and the verify call, each modelled as a fixed per-call cost plus a per-token cost, from
the wall times this coordinator measures (so RPC overhead counts, not only model compute).
Pipelined, the next round's draft runs during this round's verify and is only kept when every
draft is accepted and its first token equals the bonus token (probability ≈ α^(K+1)), so
T(K) = V(K) + (1 − α^(K+1))·D(K). K maximises E(K) / T(K).

Pure functions and a small estimator: no gRPC, no clocks; the pipeline feeds it observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round: accepted drafts plus the recovered or bonus token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def round_time_ms(k: int, alpha: float, draft: LinearCost, verify: LinearCost, pipelined: bool) -> float:
    draft_ms = draft.at(k) if k else 0.0
    if pipelined:
        return verify.at(k) + (1.0 - alpha ** (k + 1)) * draft_ms
    return verify.at(k) + draft_ms


def best_k(alpha: float, draft: LinearCost, verify: LinearCost, k_max: int, pipelined: bool) -> int:
    """argmax over K in [1, k_max] of expected tokens per millisecond (ties: smaller K)."""
    return max(range(1, k_max + 1), key=lambda k: (expected_tokens(alpha, k) / round_time_ms(k, alpha, draft, verify, pipelined), -k))


@dataclass
class LinearCost:
    """ms = fixed + per_token · n, fitted by exponentially weighted least squares."""

    fixed: float
    per_token: float
    decay: float = 0.9  # weight of the past per observation
    _w: float = 0.0
    _n: float = 0.0
    _ms: float = 0.0
    _nn: float = 0.0
    _nms: float = 0.0

    def at(self, n: int) -> float:
        return self.fixed + self.per_token * n

    def observe(self, n: int, ms: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._ms = d * self._ms + ms
        self._nn = d * self._nn + n * n
        self._nms = d * self._nms + n * ms
        mean_n, mean_ms = self._n / self._w, self._ms / self._w
        var = self._nn / self._w - mean_n**2
        if var > 0.25 and self._w > 4.0:  # K has varied enough to separate the two terms
            slope = (self._nms / self._w - mean_n * mean_ms) / var
            # Both terms stay non-negative: a noisy fit must not make tokens free or negative.
            self.per_token = min(max(0.0, slope), mean_ms / max(mean_n, 1.0))
            self.fixed = max(0.0, mean_ms - self.per_token * mean_n)
        elif mean_n > 0:
            # One K seen so far: keep the split's proportions, rescaled to the observed total.
            scale = mean_ms / max(self.at(round(mean_n)), 1e-6)
            self.fixed *= scale
            self.per_token *= scale


@dataclass
class AdaptiveK:
    """Per-session K chooser. Starts from priors (the coordinator's running figures from
    earlier requests) and learns this session's acceptance as rounds complete."""

    k_max: int
    pipelined: bool
    draft: LinearCost
    verify: LinearCost
    accepted: float = 3.0  # prior: α = 0.75 over 4 pseudo-positions
    reached: float = 4.0
    explore_every: int = 8  # every n-th round tries one K above the best, so the cost fit sees K vary
    history: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.reached, 0.999)

    def choose(self) -> int:
        k = best_k(self.alpha, self.draft, self.verify, self.k_max, self.pipelined)
        if self.explore_every and len(self.history) % self.explore_every == self.explore_every - 1:
            k = min(k + 1, self.k_max)
        self.history.append(k)
        return k

    def observe_round(self, proposed: int, accepted: int) -> None:
        """Geometric model: positions 1..accepted+1 were evaluated (all of them if none was rejected)."""
        if proposed:
            self.accepted += accepted
            self.reached += min(accepted + 1, proposed)

    def observe_draft(self, k: int, ms: float) -> None:
        self.draft.observe(k, ms)

    def observe_verify(self, k: int, ms: float) -> None:
        self.verify.observe(k, ms)
