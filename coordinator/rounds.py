"""One round of speculative decoding as data: `plan_round` decides what the round will do
before anything is sent (changing nothing), `draw_round` draws its seeds and coins, and
`coordinator.commit.commit_round` applies the round's result and settled branches to the
request, the one writer of its state (`RequestState`), returning the record its observers
read. None does I/O or reads a clock; the engine (coordinator.engine) runs the calls between
them.

A round's kind is chosen from the request's earlier outcomes and the costs the services
calibrated at start-up, never from a time measured during the request, so a seed maps to one
output on one running deployment:

    READY       drafts a kept pre-draft or hedge already holds
    CATCH_UP    a pipelined round with none ready, where a step pays (`catch_up_pays`): one
                target-only step while the draft catches its session up and drafts the round
                after it
    DRAFT_CALL  a Propose call: a chain of K, a copy (prompt lookup) or a tree
    FALLBACK    the draft is skipped (breaker open, or it refused this request lately)
    TARGET_ONLY K = 0: the target samples one token (a request that fixes K = 0: up to
                target_only_steps, one seed each, in one Verify call)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coordinator.adaptive import AdaptiveK
from coordinator.config import MAX_TARGET_ONLY_STEPS
from coordinator.features import FeatureRows
from coordinator.hedging import Acceptance, PredraftDepth
from coordinator.metrics import GenerationStats
from coordinator.overlap import Overlap
from coordinator.pair import PairInfo
from coordinator.requests import Job
from coordinator.round_costs import RoundCosts
from coordinator.state import DraftRefusals, RetryWindow, Round, SessionView
from coordinator.text import TextAssembler
from specdec.engine.costs import cost_at
from specdec.sampling.seeds import RequestStreams, next_seed
from specdec.sampling.tree_sampling import tree_size
from specdec.v1 import common_pb2

# Where K is 0 and only a copy (prompt lookup) would make a draft call, a lookup that found
# nothing is not repeated for this many rounds (calls: one K = 0 round may carry several
# steps), on any deployment. Each such call is a round of one step where a target-only round
# following the load carries several, and its RPC waits on the draft: on 2 shared cores, 4
# concurrent requests with the hybrid drafter looked up every round and ran at 0.58-0.82x
# target-only (docs/design.md, "The K chooser", under load).
COPY_WAIT_ROUNDS = 2
# A K = 0 call runs at least config.target_only_steps steps, more where passes are short: as
# many as take about this long (`steps_per_call`).
STEP_CALL_MS = 20.0


@dataclass(frozen=True)
class RoundRules:
    """Rules of the rounds that only the benchmarks and tests turn off, to compare against or
    to reach one path alone; never flags, since the defaults were measured better where they
    act (docs/benchmarks.md): catch-up steps (+11% greedy, +7% sampled on the nodes suite;
    `catch_up_pays` decides per round whether one pays) and live pass costs for the K chooser
    (1.04-1.09x after a disturbed calibration). bench.rules_coordinator runs a coordinator
    process with other rules; tests pass them to `coordinator.server.connect`."""

    catch_up: bool = True  # off: a pipelined round with no drafts ready waits for fresh ones
    live_costs: bool = True  # off: every request's K chooser uses the calibrated pass costs


DEFAULT_RULES = RoundRules()


class RoundKind(enum.Enum):
    READY = "ready"
    CATCH_UP = "catch-up"
    DRAFT_CALL = "draft"
    FALLBACK = "fallback"
    TARGET_ONLY = "target-only"


@dataclass(frozen=True)
class RoundPlan:
    """What a round will do, decided before it sends anything (`plan_round`)."""

    kind: RoundKind
    k: int  # the chain's K (a catch-up step's pre-draft drafts up to K); 0 for a tree or target-only
    copy_limit: int  # ProposeRequest.max_copied_tokens: the most a copy may carry (0: none)
    widths: tuple[int, ...]  # a tree's shape, as deep as there is room for; () for a chain
    draft_allowed: bool  # the breaker lets rounds call the draft (asked once a round)
    ready: Round | None = None  # READY: the drafts, cut to K
    steps: int = 0  # TARGET_ONLY with K fixed at 0: the Verify call's further steps (`step_count`)
    overlapping: bool = False  # it pre-drafts the next round during its verify (RequestState.overlapping)
    chosen_k: int | None = None  # the K chooser's pick this round (None: not asked)
    chosen_copy: int | None = None  # the copy chooser's (None: not asked)
    costs: RoundCosts | None = None  # the K chooser's costs at this round's load (None: unchanged)
    copy_costs: RoundCosts | None = None  # the copy chooser's

    @property
    def uniforms_needed(self) -> int:
        """One coin per position a proposal may fill (a tree's: one per node)."""
        return tree_size(self.widths) or max(self.k, self.copy_limit)


@dataclass(frozen=True)
class RoundDraws:
    """A round's random draws (`draw_round`), the same whatever the round's kind."""

    draft_seed: int
    target_seed: int
    predraft_seed: int
    uniforms: list[float]
    step_seeds: tuple[int, ...] = ()  # the Verify call's further steps (RoundPlan.steps)


@dataclass
class RequestState:
    """One request between its rounds. Its parts have one writer each:

    - the request (the pair, the sequence and text, the choosers, the draft's refusals, the
      ready drafts, the round index): `commit_round` alone;
    - the random streams: `draw_round`, and the hedges' seeds in coordinator.branches;
    - the session views: coordinator.upstream (placement, re-sends, failures, call numbers)
      and coordinator.branches (a catch-up opens the session); `commit_round` sets what each
      service holds after the round;
    - `unused_forks`: coordinator.branches;
    - `stats`: its observers (GenerationStats.observe reads each round's record).

    tests/unit/test_single_writer.py holds every module to this."""

    job: Job
    pair: PairInfo  # the pair's Info as the request began; re-read only when the draft rejects a call
    stats: GenerationStats
    streams: RequestStreams
    sampling: common_pb2.SamplingParams
    sequence: list[int]  # prompt + committed tokens
    text: TextAssembler
    draft_view: SessionView
    target_view: SessionView
    overlap: Overlap  # pipelined or not, and the hedges and bonus guesses of its branch calls
    retry: RetryWindow  # how long a verify is retried while the target is unavailable
    k_chooser: AdaptiveK | None = None  # K per round, when the request left K to the coordinator
    load_aware: bool = False  # the chooser costs rounds at the sessions sharing the services
    copy_chooser: AdaptiveK | None = None  # a copy's length, chosen apart (copies cost no pass)
    refusals: DraftRefusals = field(default_factory=DraftRefusals)
    acceptance: Acceptance = field(default_factory=Acceptance)  # of the model's chain drafts, copies apart
    ready: Round | None = None  # the next round's drafts, from a kept pre-draft or hedge
    branch_failed: bool = False  # the last branch call failed: the next round drafts afresh, never a catch-up
    unused_forks: list[str] = field(default_factory=list)  # draft sessions to end with the next branch call
    copy_wait: int = 0  # K = 0 rounds before a copy is looked for again, after a lookup found none
    predraft_depth: PredraftDepth = field(default_factory=PredraftDepth)  # pre-drafts' steps, from their timing
    # Its timed branch calls: (the round's costs at its load, Settled.timing), for the row cost.
    branch_calls: list[tuple[RoundCosts, int, int, float]] = field(default_factory=list)
    round_index: int = 0  # the clock: rounds committed, a target-only call's steps each counted
    # An EAGLE-style draft's: the target's features of committed tokens its session has not been sent.
    features: FeatureRows | None = None

    @property
    def pipelined(self) -> bool:
        return self.overlap.pipelined

    @property
    def hedging(self) -> bool:
        return self.overlap.hedges > 0

    @property
    def overlapping(self) -> bool:
        """This round pre-drafts the next during its verify: a pipelined request, unless its
        K chooser costs it beside other sessions on its target (`AdaptiveK.overlaps`)."""
        return overlaps(self, self.k_chooser)

    @property
    def remaining(self) -> int:
        """New tokens the request may still generate."""
        return self.job.max_new_tokens - len(self.text.token_ids)

    @property
    def finished(self) -> bool:
        return self.text.finish_reason is not None


def overlaps(state: RequestState, chooser: AdaptiveK | None) -> bool:
    return state.pipelined and (chooser is None or chooser.overlaps)


def k_limit(pair: PairInfo, length: int, remaining: int, most: int | None = None) -> int:
    """The most drafts a round may carry, from a sequence of `length` with `remaining` new
    tokens allowed: room for the drafts plus the recovered/bonus token, in both models, and at
    most `most` (by default the pair's largest K)."""
    room = pair.max_context - length
    most = pair.max_num_speculative_tokens if most is None else most
    return max(0, min(most, remaining - 1, room - 1, pair.draft_max_context - length))


def copy_limit(state: RequestState, pair: PairInfo, k: int, chooser: AdaptiveK | None = None) -> tuple[int, int | None]:
    """ProposeRequest.max_copied_tokens for this round, an exact cap (0: no copy; with K = 0
    too, no draft call), and the copy chooser's pick where it was asked. A request that fixes
    K copies at most K; target-only requests (K = 0) never copy. A chosen copy may be longer
    than the largest K (max_copied_tokens, 32): it runs no draft pass, so only the verify grows
    with it. `chooser`: the copy chooser at this round's costs."""
    if not pair.draft_copies or state.job.num_speculative_tokens == 0:
        return 0, None
    if chooser is None:
        return k, None
    if not k and state.copy_wait:
        return 0, None  # a copy alone costs a draft call, and the last one found nothing (COPY_WAIT_ROUNDS)
    room = k_limit(pair, len(state.sequence), state.remaining, pair.max_copied_tokens)
    chosen = chooser.pick()
    return min(chosen, room), chosen


def catch_up_pays(state: RequestState, k: int, chooser: AdaptiveK | None = None) -> bool:
    """Whether a round with no drafts ready should be a catch-up step rather than wait for K
    fresh drafts. A step commits one token in a target pass; a fresh round commits E(K) in K
    draft steps and a verify. Either starts the next round's branches, so the next round is
    about as likely to find drafts ready after both; the step pays where it commits tokens
    faster: 1 / V(0) > E(K) / (D(K) + V(K)), from the calibrated costs and the request's own
    acceptance (never from timing, so a seed still maps to one output). Where a draft step is
    a small share of a target pass (a GPU), a fresh round wins by far; where the draft is
    nearly as slow as the target (these CPUs), the step does. A request's first round is
    always a step: it prefills both models at once. Without measured costs, always a step. A
    sampled request drafts afresh after each step until a draft of its own was verified: its
    steps teach the chooser nothing (commit's `_take_branches`), so steps whose pre-drafts all
    missed would leave α where it was, and the chooser's probes would all be steps."""
    costs = state.pair.costs
    if costs is None or not state.draft_view.opened:
        return True
    if not (state.job.params.greedy or state.acceptance.reached > state.acceptance.caught_up_at):
        return False
    alpha = chooser.alpha if chooser is not None else state.acceptance.alpha
    return costs.tokens_per_ms(0, alpha, pipelined=False) > costs.tokens_per_ms(k, alpha, pipelined=False)


def prefill_outweighs(state: RequestState, k: int, alpha: float) -> bool:
    """Whether the draft's model, behind the sequence by the tokens it has not run (a long
    prompt the target alone has read so far, or tokens only copies went over), would take
    longer running them than rounds of K drafts can save over the tokens the request may
    still generate: a long prompt with a short answer. Then the round is target-only (copies,
    which run no model pass, are chosen apart). From the calibrated costs alone, so a seed
    still maps to one output; the saving assumes every remaining token is generated and the
    run is costed by extrapolating the calibrated passes, which underestimates a long one, so
    it errs towards drafting."""
    costs = state.pair.costs
    if costs is None or not costs.draft_pass_ms:
        return False
    per_token = 1 / costs.tokens_per_ms(0, alpha, pipelined=False) - 1 / costs.tokens_per_ms(k, alpha, pipelined=False)
    if per_token <= 0:
        return False  # a probe or a hunch (a K not thought to pay at α): the chooser learns from it
    behind = len(state.sequence) - min(state.draft_view.synced, state.draft_view.modeled)
    passes = costs.draft_pass_ms  # the pair's, not the replica's: a seed's K must not follow placement
    extra_ms = cost_at(passes, max(behind, 1)) - cost_at(passes, 1)  # past a round's own first pass
    return extra_ms > state.remaining * per_token


def chosen_shape(
    state: RequestState, chooser: AdaptiveK | None, first_step: bool, overlapping: bool
) -> tuple[int, tuple[int, ...], int | None]:
    """The round's K and tree widths (a chain of K: ()), and the chooser's pick (None where it
    picked none): none on a first step; the request's own without a chooser; the chooser's,
    unless a sequential round's draft would first run more than its drafts can repay, at the
    estimated α and at the α the chooser holds plausible (`prefill_outweighs`; a pipelined
    round runs that beside the target's step). Both: at the estimate a first K = 1 may pay by
    a hair (a prior of 0.6-0.65 on a 2-core CPU), too little to repay a 34-token prompt's
    prefill, and a skipped round teaches nothing, so such a request stayed target-only to its
    end (`make run`, 2026-12-07)."""
    if first_step:
        return 0, (), None
    if chooser is None:
        return state.job.num_speculative_tokens, state.job.tree_widths, None
    chosen_k = chooser.pick()
    k, shape = chooser.shape_for(chosen_k)
    drafted = state.ready is not None and bool(state.ready.draft_token_ids)  # a pre-draft costs nothing now

    def outweighs(alpha: float) -> bool:
        return prefill_outweighs(state, chosen_k, alpha)

    if chosen_k and not (overlapping or drafted) and outweighs(chooser.alpha) and outweighs(chooser.optimistic_alpha):
        return 0, (), None
    return k, shape, chosen_k


def plan_round(
    state: RequestState,
    catch_up: bool,
    draft_allowed: bool,
    target_steps: int = 1,
    costs: RoundCosts | None = None,
    copy_costs: RoundCosts | None = None,
) -> RoundPlan:
    """The round's kind, K, copy cap and tree, from the request's state and these inputs alone,
    changing nothing: called twice, it plans the same round. `catch_up`: `RoundRules.catch_up`;
    `draft_allowed`: the breaker lets rounds call the draft; `target_steps`:
    config.target_only_steps; `costs`, `copy_costs`: the choosers' costs at the load now (None:
    the ones they hold)."""
    pair = state.pair
    chooser = state.k_chooser.at(costs) if state.k_chooser is not None and costs is not None else state.k_chooser
    copier = state.copy_chooser
    if copier is not None and copy_costs is not None:
        copier = copier.at(copy_costs)
    overlapping = overlaps(state, chooser)
    limit = k_limit(pair, len(state.sequence), state.remaining)
    if chooser is not None and limit < chooser.k_max:
        chooser = chooser.within(limit)
    # A request whose K follows the load starts with a target-only step, copying nothing: its
    # first token then comes after the target's prompt pass alone, never behind the draft's,
    # and its first choice of K sees the requests that arrived with it (a burst's first would
    # see itself alone, draft, and slow every prompt pass beside it on a shared machine).
    first_step = chooser is not None and state.load_aware and not overlapping and not state.round_index
    k, shape, chosen_k = chosen_shape(state, chooser, first_step, overlapping)
    k = min(k, limit)
    copy, chosen_copy = (0, None) if shape or first_step else copy_limit(state, pair, k, copier)
    widths = tuple(shape[:limit]) if pair.trees else ()  # a draft restarted as another drafter serves no trees
    fallback = bool(k or copy or widths) and not (state.refusals.allow(state.round_index) and draft_allowed)
    if fallback:
        k, copy, widths = 0, 0, ()  # the draft is down or refused: one target-only step
    ready = state.ready if state.ready is not None and state.ready.draft_token_ids else None
    kind = round_kind(
        state, k, copy, widths, ready is not None, fallback, catch_up, draft_allowed, overlapping, chooser
    )  # fmt: skip
    return RoundPlan(
        kind,
        k,
        copy,
        widths,
        draft_allowed,
        ready.truncated(k) if kind is RoundKind.READY and ready is not None else None,
        step_count(state, kind, target_steps, chooser),
        overlapping,
        chosen_k,
        chosen_copy,
        costs if state.k_chooser is not None else None,
        copy_costs if state.copy_chooser is not None else None,
    )


def round_kind(
    state: RequestState,
    k: int,
    copy: int,
    widths: tuple[int, ...],
    ready: bool,
    fallback: bool,
    catch_up: bool,
    draft_allowed: bool,
    overlapping: bool,
    chooser: AdaptiveK | None,
) -> RoundKind:
    """The round's kind (the module docstring), tried in order."""
    if ready and k:
        return RoundKind.READY
    if (
        overlapping
        and catch_up
        and k
        and not (copy or widths)  # a copy costs no pass; a tree is not pipelined
        and not state.branch_failed
        and draft_allowed
        and catch_up_pays(state, k, chooser)
    ):
        return RoundKind.CATCH_UP  # rather than leave the target idle while the draft drafts
    if k or copy or widths:
        return RoundKind.DRAFT_CALL
    return RoundKind.FALLBACK if fallback else RoundKind.TARGET_ONLY


def draw_round(streams: RequestStreams, plan: RoundPlan) -> RoundDraws:
    """The round's seeds and coins, drawn in one order whatever its kind, so the kind never
    shifts a stream: the draft's, target's and pre-draft's seeds, one coin per position a
    proposal may fill, then the seeds of a target-only call's further steps (from the target's
    stream, as the single-step rounds they replace would draw them)."""
    draft_seed, target_seed = next_seed(streams.draft), next_seed(streams.target)
    predraft_seed = next_seed(streams.predraft)
    uniforms = streams.coins.random(plan.uniforms_needed).tolist()
    step_seeds = tuple(next_seed(streams.target) for _ in range(plan.steps))
    return RoundDraws(draft_seed, target_seed, predraft_seed, uniforms, step_seeds)


def step_count(state: RequestState, kind: RoundKind, target_steps: int, chooser: AdaptiveK | None) -> int:
    """A request that fixes K = 0 runs up to `steps_per_call` target-only steps per Verify call:
    the number after the first, whose seeds come from the target's stream as the rounds they
    replace would draw them (a K = 0 request reads no other stream), so the output does not
    depend on how many a call runs. Room is left for the last step's token in the length and the
    context. A request's first round steps once, so its first token comes as soon as the
    prompt's pass ends; so does a tree request served target-only (its next round may
    speculate). A round a K chooser made K = 0 runs the steps as well: how many depends on the
    calibrated costs and the request's own state, as its K does, so a seed keeps one output;
    under load the calls saved are the coordinator's CPU, which a shared machine's target needs."""
    if kind is not RoundKind.TARGET_ONLY or not state.round_index:
        return 0
    if chooser is None and (state.job.num_speculative_tokens or state.job.tree_widths):
        return 0
    per_call = steps_per_call(target_steps, state.pair.costs)
    more = min(per_call - 1, state.remaining - 1, state.pair.max_context - len(state.sequence) - 1)
    return max(0, more)


def steps_per_call(target_steps: int, costs: RoundCosts | None) -> int:
    """A K = 0 call's steps: `target_steps` (config.target_only_steps), or more where the
    target's one-token pass is short, as many as take about STEP_CALL_MS of passes (at most
    MAX_TARGET_ONLY_STEPS). A call costs its framework's part (gRPC and both ends' Python, a
    millisecond or more) however short its passes, so on a 2 ms pass four steps a call leave a
    third of the time outside the passes; its tokens still stream every STEP_CALL_MS or so."""
    if costs is None or not costs.target_pass_ms:
        return target_steps
    fitting = int(STEP_CALL_MS // max(cost_at(costs.target_pass_ms, 1), 1e-3))
    return max(target_steps, min(fitting, MAX_TARGET_ONLY_STEPS))
