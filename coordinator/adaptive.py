"""Choosing K each round, K = 0 included, from what passes cost on the services' own hardware.

The pass costs of a seeded sampled request come from the services' start-up calibration
(Info.calibrated_pass_ms) and the RPC cost from the coordinator's own start-up round trips;
neither moves until a restart, and the acceptance estimate is built from the request's own
rounds, from a prior that is fixed for seeded requests. So its K never depends on wall times
measured during a request, and the same seed on the same running deployment gives the same
output. A request whose output K cannot change (greedy, or unseeded) is costed each round from
the services' live figures instead (Info.live_pass_ms: each size's recent passes, settled as
calibration settles them; `RoundRules.live_costs`): a machine's pass costs move after start-up, and a
K chosen for costs that no longer hold runs slower (docs/design.md, "The K chooser").

What a round costs and commits, the figures this maximises, is coordinator.round_costs.

Pure functions and a small estimator: no gRPC, no clocks; the round loop feeds it outcomes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from coordinator.round_costs import RoundCosts, best_k, best_tree

DEFAULT_ALPHA_PRIOR = 0.6  # before any round: a draft of the same family agrees about this often
PRIOR_WEIGHT = 2.0  # pseudo-positions the prior counts for
PROBE_EVERY = 8  # after this many K = 0 rounds in a row, one round speculates to re-measure α
QUICK_PROBE_EVERY = 2  # ... or this many, while speculation would still pay at a plausible α
PLAUSIBLE_ERRORS = 2.0  # "plausible": within this many standard errors above the estimate
PROBE_GAIN = 1.05  # ... and would pay by this factor (a marginal gain is not worth dear probes)
# Under load (other sessions on the target), K > 0 only where it beats target-only by this
# factor: a margin for what the cost models leave out (the lockstep model, passes split between
# sessions drafting and sessions stepping; both, calibration noise), docs/design.md, "The K
# chooser", under load.
LOAD_GAIN = 1.1


DEFAULT_RESCUE_PRIOR = 0.5  # a hedge at the rejected position guessed the recovered token
DEFAULT_BETA_PRIOR = 0.3  # a runner-up child accepted after the first child's rejection


@dataclass
class AdaptiveK:
    """Per-request K chooser. Learns this request's acceptance as rounds complete, starting
    from a prior; when speculating does not pay it picks K = 0, and every `probe_interval`
    target-only rounds it speculates once at the best K > 0 so that a rise in acceptance
    (code after prose, say) is noticed."""

    k_max: int
    pipelined: bool
    costs: RoundCosts
    alpha_prior: float = DEFAULT_ALPHA_PRIOR
    probe_every: int = PROBE_EVERY
    accepted: float = 0.0
    reached: float = 0.0
    zero_streak: int = 0  # K = 0 rounds since the last speculative one
    history: list[int] = field(default_factory=list)  # the K of each round planned
    # Tree shapes (`trees`): β, the acceptance of a root child after the first was rejected,
    # learned from tree rounds as α is from every round.
    trees: bool = False
    beta_prior: float = DEFAULT_BETA_PRIOR
    beta_accepted: float = 0.0
    beta_reached: float = 0.0
    # Pipelined with hedges (`hedged`): ρ, how often a hedge assumed the rejection that
    # happened, learned from the rounds that ended in one.
    hedged: bool = False
    rescue_prior: float = DEFAULT_RESCUE_PRIOR
    rescue_hits: float = 0.0
    rescue_tries: float = 0.0

    def __post_init__(self) -> None:
        self.accepted += PRIOR_WEIGHT * self.alpha_prior
        self.reached += PRIOR_WEIGHT
        self.beta_accepted += PRIOR_WEIGHT * self.beta_prior
        self.beta_reached += PRIOR_WEIGHT
        self.rescue_hits += PRIOR_WEIGHT * self.rescue_prior
        self.rescue_tries += PRIOR_WEIGHT

    @property
    def rescue(self) -> float:
        """ρ, or 0 without hedges."""
        return self.rescue_hits / self.rescue_tries if self.hedged and self.pipelined else 0.0

    def observe_rescue(self, hit: bool) -> None:
        """A hedged round that ended in a rejection: whether a hedge had assumed it."""
        self.rescue_tries += 1.0
        self.rescue_hits += hit

    @property
    def beta(self) -> float:
        return min(self.beta_accepted / self.beta_reached, 0.999)

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.reached, 0.999)

    @property
    def optimistic_alpha(self) -> float:
        """α plus one standard error of its estimate."""
        return self._alpha_above(1.0)

    def _alpha_above(self, standard_errors: float) -> float:
        alpha = self.alpha
        return min(alpha + standard_errors * math.sqrt(alpha * (1.0 - alpha) / self.reached), 0.999)

    @property
    def probe_interval(self) -> int:
        """K = 0 rounds before a probe: QUICK_PROBE_EVERY while speculating would pay (by
        PROBE_GAIN) for an α PLAUSIBLE_ERRORS standard errors above the estimate, else
        `probe_every`. Why: a K = 0 round teaches nothing, and early in a request the estimate
        rests on a few positions, so one rejection in the first round (α 0.6 → 0.4 with the
        prior's weight of 2) would park a request for `probe_every` rounds whatever its drafts
        are. Where nothing plausible pays (a steep verify cost, or many rejections), probes
        stay rare. Evidence: docs/design.md, "The K chooser"."""
        alpha = self._alpha_above(PLAUSIBLE_ERRORS)
        k = best_k(alpha, self.costs, self.k_max, self.pipelined, rescue=self.rescue)
        rate = self.costs.tokens_per_ms(k, alpha, self.pipelined, self.rescue)
        gain = rate / self.costs.tokens_per_ms(0, alpha, False)
        if gain >= PROBE_GAIN:
            return min(self.probe_every, QUICK_PROBE_EVERY)
        return self.probe_every

    @property
    def loaded(self) -> bool:
        """Costed with other sessions sharing the target (`RoundCosts.at_load`)."""
        return self.costs.target_sessions > 1

    @property
    def overlaps(self) -> bool:
        """Pipelined and alone on the target: its rounds draft the next during their verify."""
        return self.pipelined and self.costs.overlaps

    def gain(self, k: int, alpha: float) -> float:
        """Tokens per millisecond at K over those of target-only steps."""
        costs = self.costs
        return costs.tokens_per_ms(k, alpha, self.pipelined, self.rescue) / costs.tokens_per_ms(0, alpha, False)

    def at(self, costs: RoundCosts) -> AdaptiveK:
        """This chooser as it would choose at `costs` (the load now): a copy, so a round's
        plan may read it without changing the request's chooser (commit_round does that)."""
        chooser = copy.copy(self)  # (the history list is shared: only observe_choice adds to it)
        chooser.costs = costs
        return chooser

    def within(self, k_max: int) -> AdaptiveK:
        """This chooser choosing among K ≤ k_max (the tokens left): a copy, as `at`. Near the
        end the best K that fits is not the best K cut to fit (one draft may be slower than none
        where the unbounded best is eight)."""
        chooser = copy.copy(self)
        chooser.k_max = min(self.k_max, k_max)
        return chooser

    def choose(self) -> int:
        """`pick`, counted as the round's choice (`observe_choice`)."""
        k = self.pick()
        self.observe_choice(k)
        return k

    def observe_choice(self, k: int) -> None:
        """A round planned with the K `pick` chose: K = 0 rounds count toward a probe."""
        self.zero_streak = self.zero_streak + 1 if k == 0 else 0
        self.history.append(k)

    def pick(self) -> int:
        """The best K for the estimated α; but the best K > 0 for it (a probe's K), not 0,
        while K > 0 would pay for an α one standard error higher. Why: a K = 0 round teaches
        nothing about α, so choosing for the estimate alone lets an early rejection (or the
        prior) park a request at K = 0 between probes although its drafts are good, which
        costs most where acceptance is high. Such a round costs little where K = 0 and the
        best K > 0 are close in value, and the uncertainty shrinks as drafts are evaluated, so
        a draft that is truly poor still settles at K = 0 with probes. Not K = 1 whatever the
        costs: where a draft step is dear and verifying more costs little (captured passes),
        one draft is the worst K > 0. Evidence: docs/design.md, "The K chooser"."""
        k = best_k(self.alpha, self.costs, self.k_max, self.pipelined, rescue=self.rescue)
        if self.loaded:
            # Shared services: speculate only for a clear gain, never on a hunch (probes
            # only where a plausible α would clear the bar). On a shared host
            # none at all: a probe's calls take its session out of the others' batch, and its
            # multi-step calls then miss that batch at every boundary after (module docstring).
            if k and self.gain(k, self.alpha) < LOAD_GAIN:
                k = 0
            plausible_alpha = self._alpha_above(PLAUSIBLE_ERRORS)
            plausible = best_k(plausible_alpha, self.costs, self.k_max, self.pipelined, rescue=self.rescue)
            may_probe = (
                not self.costs.shared_host and bool(plausible) and self.gain(plausible, plausible_alpha) >= LOAD_GAIN
            )
            hunch = False
        else:
            plausible = best_k(self.optimistic_alpha, self.costs, self.k_max, self.pipelined, rescue=self.rescue)
            may_probe, hunch = True, bool(plausible)
        if k == 0 and self.k_max and (hunch or self._probe_due(may_probe)):
            k = best_k(self.alpha, self.costs, self.k_max, self.pipelined, k_min=1, rescue=self.rescue)
        return k

    def _probe_due(self, may_probe: bool) -> bool:
        """Whether a probe is due: `probe_interval` K = 0 rounds in a row (worked out only for
        a K = 0 round without a hunch: it prices the best K at a plausible α)."""
        return bool(self.probe_every) and may_probe and self.zero_streak >= self.probe_interval

    def choose_shape(self) -> tuple[int, tuple[int, ...]]:
        """(K, ()) for a chain round, or (0, tree_widths) where a tree (width, 1, …, 1) beats
        the best chain in expected tokens per millisecond at the estimated α and β. Sequential
        rounds only (a tree is never pre-drafted), so trees are weighed only when not pipelined.
        Like K, the shape depends only on the request's own rounds and the fixed costs."""
        return self.shape_for(self.choose())

    def shape_for(self, k: int) -> tuple[int, tuple[int, ...]]:
        """(K, ()) or (0, tree widths) for the K `pick` chose: `choose_shape`, without counting
        the choice."""
        if not self.trees or self.pipelined or not k or self.loaded:
            return k, ()  # a tree's rate is priced for one session alone: under load only chains are
        widths, rate = best_tree(self.alpha, self.beta, self.costs, self.k_max)
        if widths and rate > self.costs.tokens_per_ms(k, self.alpha, False):
            return 0, widths
        return k, ()

    def observe_tree(self, widths: tuple[int, ...], path: list[int]) -> None:
        """A (width, 1, …, 1) round's evidence: the root's first child (node 1) is one α trial;
        after its rejection the children tried next are β trials (node j accepted: j − 2
        rejections then one acceptance); the chain below the accepted child counts for α as a
        chain round does."""
        width, depth = widths[0], len(widths)
        first = path[0] if path else 0
        self.reached += 1.0
        self.accepted += first == 1
        if first != 1:
            tried = width - 1 if not first else first - 1
            self.beta_reached += tried
            self.beta_accepted += bool(first)
        if first:
            self.observe_round(depth - 1, len(path) - 1)

    def observe_round(self, proposed: int, accepted: int) -> None:
        """Geometric model: positions 1..accepted+1 were evaluated (all of them if none was rejected)."""
        if proposed:
            self.accepted += accepted
            self.reached += min(accepted + 1, proposed)
