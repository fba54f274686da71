"""Hedged pre-drafts: which rejection outcomes to pre-draft for while the target verifies.

A round of K drafts ends in one of K + 1 ways: all accepted (the bonus case, which
`--pipeline` pre-drafts for) or "draft j rejected, token t recovered" for some j < K and t.
A hedge drafts the next round for one such (j, t) on a fork of the draft's session. The next
round uses a hedge only when the round ended exactly as it assumed, so the choice depends on
the verification outcome alone, and the hedge's drafts were drawn from the draft given exactly
the committed prefix: the next round verifies them against the distributions they came from,
which keeps the output distribution the target's (the argument in `Engine.generate`).

Which (j, t) to hedge is a guess and only changes the hit rate, never the output. With
per-token acceptance α, the round reaches draft j with probability α^j and rejects it with
1 − α; given a rejection, the recovered token comes from where the target outweighs the draft,
and the draft's own runner-ups at j (its likeliest other tokens) are its best guesses for that.
Hedging several runner-ups per position is SpecActor's fan-out (sglang#22520): on the
synthetic 0.8 pair the target's token after a rejection is the draft's first runner-up 59% of
the time and among its first three 99%. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from specdec.rpc import wire


@dataclass(frozen=True)
class Hedge:
    position: int  # j: drafts accepted before the rejection (the rejected draft's index)
    recovered_token_id: int  # t: the recovered token it assumes
    score: float  # estimated probability of exactly this outcome


def plan_hedges(
    runner_up_ids: Sequence[Sequence[int]],  # [K][R] per draft position, the draft's likeliest other tokens
    runner_up_probs: Sequence[Sequence[float]],  # [K][R] their draft probabilities
    alpha: float,
    limit: int,
    skip_token_ids: Collection[int] = (),
) -> list[Hedge]:
    """The `limit` likeliest rejection outcomes, by α^j·(1 − α)·p_jr over every position j and
    runner-up r, best first: a late position's first runner-up can outrank an early one's second.

    Outcomes whose recovered token is in `skip_token_ids` (end of sequence: no next round to
    draft) are left out.
    """
    alpha = min(max(alpha, 0.05), 0.95)  # a neutral prior at the extremes keeps every j in play
    hedges = [
        Hedge(j, int(token), alpha**j * (1.0 - alpha) * float(prob))
        for j, (tokens, probs) in enumerate(zip(runner_up_ids, runner_up_probs, strict=True))
        for token, prob in zip(tokens, probs, strict=True)
        if int(token) not in skip_token_ids and prob > 0.0
    ]
    hedges.sort(key=lambda hedge: (-hedge.score, hedge.position))
    return hedges[:limit]


def runner_ups_for(hedges: int) -> int:
    """How many runner-ups per position a request hedging `hedges` outcomes asks the draft
    for (ProposeRequest.runner_ups): enough that its likeliest outcomes may all sit at one
    position, within the protocol's limit; 0 (the draft's one) when it does not hedge."""
    return min(hedges, wire.MAX_RUNNER_UPS) if hedges > 1 else 0


@dataclass
class Acceptance:
    """The per-position acceptance α of a request's model drafts so far (copies apart, which
    accept at rates of their own): accepted drafts over the positions the rounds reached (a
    round reaches its accepted drafts and the one rejected), pulled toward `prior` by `weight`
    pseudo-positions. Per position, as E(K) = (1 − α^(K+1)) / (1 − α) needs it: accepted over
    proposed would read α 0.81 as 0.59 at K = 6."""

    prior: float = 0.75
    weight: float = 2.0
    accepted: int = 0
    reached: int = 0
    caught_up_at: int = 0  # `reached` as the request's last catch-up step committed (rounds.catch_up_pays)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.accepted += accepted
            self.reached += min(accepted + 1, proposed)

    @property
    def alpha(self) -> float:
        return (self.accepted + self.weight * self.prior) / (self.reached + self.weight)


# Weight of the newest round in PredraftDepth's running slack.
SLACK_WEIGHT = 0.3


@dataclass
class PredraftDepth:
    """How many steps a request's pre-drafts take for up to k drafts: the bonus guess and k
    drafts after it (k + 1 steps), or the guess and k − 1 drafts (k steps) when the last step
    has been coming back after the verify it runs beside.

    Hedges draft k tokens in k steps, so the pre-draft's last step is the one step of a branch
    call that runs after every other branch is done. Where the draft is far (a 2 ms link) or
    slow, that step is what the next round waits for; without it, the call ends with the hedges.
    The next round then carries one draft fewer after a fully accepted round, and none of its
    wait. Measured on emulated H100s (70B target, 1B draft, α 0.8, 12 hedges): at 2 ms links
    the shorter pre-draft ran 166 tok/s against 159; at 0.05 ms, where the step is hidden, 172
    against 181.

    `slack_ms`: a running estimate of how long before its verify a k + 1-step pre-draft's call
    replies (negative: after). The timing decides only how many drafts a branch proposes,
    never which branch a round takes, so the output stays exact; a seeded sampled request's
    drafts may depend on nothing but itself, so it never observes (and keeps k + 1 steps)."""

    slack_ms: float | None = None

    def steps(self, k: int) -> int:
        return k + 1 if k < 2 or self.slack_ms is None or self.slack_ms >= 0 else k

    def observe(self, slack_ms: float, step_ms: float, full: bool) -> None:
        """The last pre-draft's call replied `slack_ms` before its verify did (negative:
        after); `full`: it took k + 1 steps (`steps`), else `step_ms`, what a draft step costs,
        reads its k-step call as a k + 1-step one."""
        slack_ms = slack_ms if full else slack_ms - step_ms
        if self.slack_ms is not None:
            slack_ms = (1 - SLACK_WEIGHT) * self.slack_ms + SLACK_WEIGHT * slack_ms
        self.slack_ms = slack_ms
