"""Each request's choosers (coordinator.adaptive): its K chooser and its copy chooser, built
as it begins from the acceptance earlier requests saw, costed each round at the load its
replicas carry, and their acceptance carried on to the next request's priors."""

from __future__ import annotations

import dataclasses
import logging

from coordinator.adaptive import DEFAULT_ALPHA_PRIOR, PRIOR_WEIGHT, AdaptiveK
from coordinator.config import CoordinatorConfig
from coordinator.overlap import Overlap, RowCost, choose_overlap, row_cost_sample
from coordinator.pair import PairInfo
from coordinator.requests import Job
from coordinator.round_costs import RoundCosts
from coordinator.rounds import RequestState, RoundRules, steps_per_call

logger = logging.getLogger(__name__)


class Choosers:
    """Builds and costs the choosers of each request, and keeps the priors they learn."""

    def __init__(self, config: CoordinatorConfig, rules: RoundRules) -> None:
        self.config = config
        self.rules = rules
        # The K chooser's acceptance prior, and the copy chooser's, learned from finished
        # requests (seeded sampled requests start from the fixed default, so their K depends
        # only on themselves).
        self._alpha_prior = DEFAULT_ALPHA_PRIOR
        self._copy_alpha_prior = DEFAULT_ALPHA_PRIOR
        self._overlap: dict[bool, tuple[bool, int, int]] = {}  # the last overlap chosen, greedy/sampled
        self._row_cost = RowCost()  # what a branch call's row costs a step, from finished requests' calls

    def _costs(self, job: Job, pair: PairInfo) -> RoundCosts | None:
        """The pair's calibrated costs, and, but for a seeded sampled request (whose overlap and
        K, like its output, depend on nothing but itself), the row cost learned so far."""
        if pair.costs is None or job.seeded_sampled:
            return pair.costs
        return self._row_cost.priced(pair.costs)

    def costs_at_load(self, state: RequestState) -> tuple[RoundCosts | None, RoundCosts | None]:
        """The choosers' costs for this round: at the sessions the request's replicas hold now
        (its own included), recorded in its stats, and their live pass costs at their last Info
        (`RoundRules.live_costs`); alone and calibrated for a seeded sampled request."""
        if state.k_chooser is None:
            return None, None
        target, draft = state.target_view.replica, state.draft_view.replica
        sessions = target.load[0] if state.load_aware and target is not None else 1
        draft_sessions = draft.load[0] if state.load_aware and draft is not None else 1
        live = state.load_aware and self.rules.live_costs
        target_ms = target.info.live_pass_ms if live and target is not None and target.info is not None else ()
        draft_ms = draft.info.live_pass_ms if live and draft is not None and draft.info is not None else ()
        costs = state.k_chooser.costs.at_load(sessions, draft_sessions).with_passes(target_ms, draft_ms)
        copy_costs = None
        if state.copy_chooser is not None:  # copies lengthen every batched verify too; they run no draft pass
            copy_costs = state.copy_chooser.costs.at_load(sessions, draft_sessions).with_passes(target_ms)
        state.stats.sessions_per_round.append(sessions)
        return costs, copy_costs

    def overlap(self, job: Job, pair: PairInfo) -> Overlap:
        """What the request's rounds draft during their verify (coordinator.overlap): the flags'
        choice, or the cost model's at the acceptance the request's K chooser starts from."""
        ks = tuple(range(1, pair.chooser_max_k + 1)) if chooses_k(job, pair) else (job.num_speculative_tokens,)
        alpha = DEFAULT_ALPHA_PRIOR if job.seeded_sampled else self._alpha_prior
        config, sampled = self.config, not job.params.greedy
        # A tree round is never pipelined: a tree request, or one the tree chooser may give a
        # tree, runs sequential rounds unless the flags say otherwise.
        costs = None if job.tree_widths or config.tree_chooser else self._costs(job, pair)
        overlap = choose_overlap(
            costs,
            round(alpha, 2),
            ks,
            config.pipeline,
            config.hedges,
            config.bonus_guesses,
            sampled=sampled,
        )
        shape = (overlap.pipelined, overlap.hedges, overlap.bonus_guesses)
        if shape != self._overlap.get(sampled):  # said when it changes (greedy and sampled apart)
            self._overlap[sampled] = shape
            logger.info(
                "overlap for %s requests: %s, %d hedges, %d bonus guesses (acceptance prior %.2f)",
                "sampled" if sampled else "greedy",
                "pipelined" if overlap.pipelined else "sequential",
                overlap.hedges,
                overlap.bonus_guesses,
                alpha,
            )
        return overlap

    def k_chooser(self, job: Job, pair: PairInfo, overlap: Overlap) -> AdaptiveK | None:
        """A per-request K chooser where neither the request nor --num-speculative-tokens fixed K."""
        if not chooses_k(job, pair):
            return None  # K fixed, or no measured costs to choose from: the default K
        priced = self._costs(job, pair)
        assert priced is not None
        costs = overlap.costs(priced, guesses=False)
        # Its K = 0 rounds run several steps a call (rounds.step_count), each charged a share.
        costs = dataclasses.replace(costs, target_only_steps=steps_per_call(self.config.target_only_steps, costs))
        return AdaptiveK(
            k_max=pair.chooser_max_k,
            pipelined=overlap.pipelined,
            costs=costs,
            # A seeded sampled request's output depends on K, so its K may depend on nothing but
            # itself; greedy output is the target's whatever K is.
            alpha_prior=DEFAULT_ALPHA_PRIOR if job.seeded_sampled else self._alpha_prior,
            # Trees are verified exactly only: a relaxed request's chooser weighs chains alone.
            trees=self.config.tree_chooser
            and pair.trees
            and not overlap.hedges
            and job.relaxed is None
            and not job.params.penalizes,
            hedged=overlap.hedges > 0,
            rescue_prior=overlap.rescue,
        )

    def copy_chooser(self, k_chooser: AdaptiveK | None, job: Job, pair: PairInfo) -> AdaptiveK | None:
        """How many tokens a copy may carry, when the draft copies by prompt lookup and K is
        left to the chooser: a second chooser over the same target costs with drafts that cost
        nothing (a copy runs no pass), learning from copied rounds only. Long copies pay where
        they are right (an edit that repeats code), short ones where they are not, since each
        copied token lengthens the verify."""
        if k_chooser is None or not pair.draft_copies or pair.costs is None:
            return None
        free_drafts = dataclasses.replace(
            pair.costs, draft_pass_ms=(0.0,) * len(pair.costs.draft_pass_ms), draft_batch=None
        )
        return AdaptiveK(
            k_max=pair.max_copied_tokens,
            pipelined=False,
            costs=free_drafts,
            alpha_prior=DEFAULT_ALPHA_PRIOR if job.seeded_sampled else self._copy_alpha_prior,
        )

    def learn(self, state: RequestState) -> None:
        """Carries the finished request's acceptance, of its drafts and of its copies, into the
        next request's priors; a relaxed request's, higher than exact acceptance, would mislead
        the exact requests after it. (A request whose copies were right ramps its copies up to
        max_copied_tokens within a few rounds; the next one starts nearer where it ended.) What
        a greedy request's branch calls took teaches the row cost (`RowCost`; a sampled row also
        samples and keeps its sparse distribution, which auto's greedy hedges do not)."""
        if state.job.params.greedy:
            for costs, rows, steps, call_ms in state.branch_calls:  # what each took beyond its costs
                self._row_cost.observe(row_cost_sample(costs, rows, steps, call_ms))
        if state.job.relaxed is None:
            self._alpha_prior = learned_prior(self._alpha_prior, state.k_chooser)
            self._copy_alpha_prior = learned_prior(self._copy_alpha_prior, state.copy_chooser)


def learned_prior(prior: float, chooser: AdaptiveK | None) -> float:
    """The next request's acceptance prior after a request whose chooser saw evidence beyond
    its own prior: a moving average over requests."""
    if chooser is None or chooser.reached <= PRIOR_WEIGHT:
        return prior
    return 0.8 * prior + 0.2 * chooser.alpha


def chooses_k(job: Job, pair: PairInfo) -> bool:
    """K is the chooser's: neither the request nor --num-speculative-tokens fixed it (nor 0),
    and the services measured the costs to choose from."""
    return bool(job.num_speculative_tokens_unset and job.num_speculative_tokens) and pair.costs is not None
