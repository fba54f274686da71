"""Which overlap a request runs, chosen as it starts from the cost model that chooses K
(coordinator.adaptive): sequential rounds, or pipelined ones (the next round pre-drafted during
this round's verify) with how many hedges and bonus guesses riding in the pre-draft's call.
`--pipeline`, `--hedges` and `--bonus-guesses` fix a part; `auto` (their default) leaves it here.
The choice is costed for a request alone; beside other sessions on its target a round runs
sequential (`RoundCosts.overlaps`), and then carries none of the hedges auto chose either: each
is a fork of the draft session, holding a session and a KV copy on the draft for nothing.

A pipelined round of K costs max(V(K), P(K + 1)) + m·D(K) (`RoundCosts.round_ms`): P is the
branch call, its rows (the pre-draft, each further bonus guess, each hedge) stepped together, so
on an accelerator a row costs little and on a CPU nearly a pass. The pre-draft is kept when every
draft is accepted and a guess is the bonus token, or when a hedge assumed the rejection that
happened; m is the chance of neither. How likely each is comes from a prior over which of the
draft's likeliest tokens the target picks where it disagrees with the draft's first:
RUNNER_UP_SHARES (the synthetic 0.8 pair measured 59% for the first runner-up and 99% within
three; real pairs spread wider, so the prior halves each rank). The request's chooser then learns
its own hedges' hit rate from its rounds (`AdaptiveK.observe_rescue`), starting from this one.

A branch call's rows are priced as passes of at most the draft's batch size (`predraft_ms`):
the service steps them in one pass, but each fork also copies its parent's KV and samples its
rows, outside the calibrated passes. Priced as one pass over all its rows, auto chose 8 hedges
on a flat 20 / 4 ms profile and ran 0.72x the best mode, its branch calls replying 9 ms after
the verify; priced this way it chose 4 and matched the best. What each row costs a step beyond
the pass (its fork, its sampling, its part of the reply at both ends) is learned from the calls
themselves (`RowCost`): emulated (70B / 1B H100 profiles, α 0.8, AVX-512 machine), a draft whose
batched pass calibrated flat at 2.0 ms took 22 ms for a call of 5 rows and 9 steps, 21 ms for
10 rows and 4 steps, 25 ms for 14 rows and 4 steps, 0.06-0.08 ms a row a step more than the
model. Unpriced, auto chose 8-12 hedges up to α 0.76 there, and ran 0.87-0.94 of the best
hand-set mode; priced, four from its second request, and 0.92-1.10 (docs/design.md).

Only greedy requests get branches of auto's choosing. A sampled row's step also samples, keeps
its sparse distribution and its runner-ups, which the calibrated passes leave out, and its
recovered tokens spread wider than the prior says: emulated (70B/1B H100 profiles, α 0.8,
T = 0.7, AVX2), 4 hedges ran at 0.85× pipelining without them, their branch calls replying
8 ms after the verify.

Sequential wins where the draft's step is dear, the verify steep, or both models share a
machine's cores (`RoundCosts.shared_host`: a pre-draft then takes turns with the verify rather
than hiding behind it); a richer overlap must beat a plainer one by OVERLAP_GAIN, for the work
its branches cost the coordinator and the draft that the model leaves out. Seeded sampled
requests are costed from the calibrated figures and the fixed prior alone, so a seed's output
(which depends on the overlap, as on K) stays one. Pure: no I/O, no clocks.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from coordinator.adaptive import DEFAULT_RESCUE_PRIOR
from coordinator.round_costs import RoundCosts

# Given a disagreement, the chance that the target's token is the draft's r-th likeliest other one.
RUNNER_UP_SHARES = (0.5, 0.25, 0.125, 0.0625)
HEDGE_COUNTS = (0, 1, 2, 4, 8, 12)  # the hedge counts weighed
GUESS_COUNTS = (1, 2, 3)  # the bonus guesses weighed
OVERLAP_GAIN = 1.03
ROW_COST_WEIGHT = 0.1  # the newest call's weight in RowCost's running mean, past its first ten


@dataclass(frozen=True)
class Overlap:
    """What a request's rounds draft during their verify."""

    pipelined: bool = False
    hedges: int = 0
    bonus_guesses: int = 1
    rescue: float = DEFAULT_RESCUE_PRIOR  # the chance a hedge assumed a round's rejection: the chooser's prior
    chosen: bool = False  # auto chose the hedges: they ride only in rounds that pre-draft

    @property
    def rows(self) -> int:
        return self.bonus_guesses + self.hedges

    def costs(self, costs: RoundCosts, guesses: bool = True) -> RoundCosts:
        """`costs` with this overlap's branch call: its rows, and (`guesses`) the further
        guesses' share of kept pre-drafts. The K chooser prices the rows but credits no extra
        guesses (docs/design.md, the K chooser: crediting them chose longer, slower rounds)."""
        share = sum(RUNNER_UP_SHARES[: self.bonus_guesses - 1]) if guesses else 0.0
        return dataclasses.replace(costs, branch_rows=self.rows, guess_share=share)


def rescue_share(alpha: float, k: int, hedges: int) -> float:
    """ρ: given that a round of K drafts rejected one, the chance that one of `hedges` hedges
    assumed that outcome, the hedges being the likeliest outcomes (draft j rejected, runner-up r
    recovered: α^j·(1 − α)·share_r) as coordinator.hedging picks them."""
    if not (k and hedges):
        return 0.0
    weights = sorted((alpha**j * share for j in range(k) for share in RUNNER_UP_SHARES), reverse=True)
    return sum(weights[:hedges]) / sum(alpha**j for j in range(k))


@functools.lru_cache(maxsize=256)
def choose_overlap(
    costs: RoundCosts | None,
    alpha: float,
    ks: tuple[int, ...],
    pipeline: bool | None,
    hedges: int | None,
    bonus_guesses: int | None,
    sampled: bool = False,
) -> Overlap:
    """The overlap with the most tokens per millisecond at acceptance `alpha`, over the Ks in
    `ks` (the request's fixed K, or the chooser's range), among those the flags leave open
    (None: auto). Auto is the plainest (sequential, no hedges, one guess) where nothing is
    costed, where both models share the host's cores, and where K is 0; for a `sampled`
    request it pipelines or not but adds no branches (module docstring). A hand-set hedge
    count keeps the chooser's neutral prior for its hit rate."""
    if not any(ks):
        return Overlap()  # target-only: nothing to overlap
    given = Overlap(bool(pipeline), hedges or 0, bonus_guesses or 1, DEFAULT_RESCUE_PRIOR)
    if costs is None or costs.shared_host or None not in (pipeline, hedges, bonus_guesses):
        return given
    best: tuple[float, Overlap] | None = None
    if sampled:
        hedges, bonus_guesses = 0 if hedges is None else hedges, 1 if bonus_guesses is None else bonus_guesses
    for overlap in candidates(pipeline, hedges, bonus_guesses):
        k, rate = best_rate(costs, overlap, alpha, ks)
        if hedges is None and overlap.hedges:
            overlap = dataclasses.replace(overlap, rescue=rescue_share(alpha, k, overlap.hedges), chosen=True)
        if best is None or rate > best[0] * OVERLAP_GAIN:
            best = (rate, overlap)
    assert best is not None
    return best[1]


def candidates(pipeline: bool | None, hedges: int | None, guesses: int | None) -> list[Overlap]:
    """The overlaps the flags leave open, plainest first."""
    found = []
    for pipelined in [pipeline] if pipeline is not None else [False, True]:
        hedge_counts = [hedges] if hedges is not None else HEDGE_COUNTS if pipelined else [0]
        guess_counts = [guesses] if guesses is not None else GUESS_COUNTS if pipelined else [1]
        found += [Overlap(pipelined, h, g, DEFAULT_RESCUE_PRIOR) for h in hedge_counts for g in guess_counts]
    return sorted(found, key=lambda o: (o.pipelined, o.rows))


def best_rate(costs: RoundCosts, overlap: Overlap, alpha: float, ks: tuple[int, ...]) -> tuple[int, float]:
    """The best K of `ks` for this overlap, and its tokens per millisecond."""
    shaped = overlap.costs(costs)
    rates = {k: shaped.tokens_per_ms(k, alpha, overlap.pipelined, rescue_share(alpha, k, overlap.hedges)) for k in ks}
    k = max(rates, key=lambda k: (rates[k], -k))
    return k, rates[k]


def row_cost_sample(costs: RoundCosts, rows: int, steps: int, call_ms: float) -> float:
    """How much longer a pre-drafting branch call of `rows` rows and `steps` steps took, from
    its send to its reply, than `costs` (its round's, at the load it ran beside) say, a row a
    step: RowCost's sample. Negative where it was quicker."""
    predicted = dataclasses.replace(costs, branch_rows=rows, branch_row_ms=0.0).predraft_ms(steps)
    return (call_ms - predicted) / (rows * steps)


@dataclass
class RowCost:
    """What each row of a pre-drafting branch call costs a draft step beyond the calibrated
    batched pass (RoundCosts.branch_row_ms), learned from greedy requests' calls of two rows or
    more (`row_cost_sample`, Choosers.learn): a running mean, the newest call weighted
    ROW_COST_WEIGHT once it has ten before it, never priced below 0. A call of one row (the
    pre-draft alone) is a draft call, costed as one (`RoundCosts.draft_ms`), and teaches
    nothing here."""

    ms: float = 0.0
    calls: int = 0

    def observe(self, sample_ms: float) -> None:
        self.calls += 1
        self.ms += max(ROW_COST_WEIGHT, 1.0 / self.calls) * (sample_ms - self.ms)

    def priced(self, costs: RoundCosts) -> RoundCosts:
        """`costs` with the learned row cost, to 0.01 ms (choose_overlap is cached on its costs)."""
        return dataclasses.replace(costs, branch_row_ms=max(round(self.ms, 2), 0.0))
