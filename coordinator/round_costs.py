"""What a round costs, and what it commits: the model the K chooser (coordinator.adaptive)
maximises over K, from what passes cost on the services' own hardware.

Leviathan et al.: with per-token acceptance α, a round of K drafts commits on average
E(K) = (1 − α^(K+1)) / (1 − α) tokens (E(0) = 1: a target-only step). A sequential round
costs T(K) = D(K) + V(K): the draft call, K one-token draft passes plus an RPC, and the
verify call, one target pass over K + 1 new tokens plus an RPC (a target-only call of several
steps, coordinator.rounds.step_count, charging each step its share of that RPC). Pipelined,
the next round's drafts (K + 1 steps: the bonus guess, then K) run during this round's verify,
on the critical path only past its end, and are kept when every draft is accepted and the
guess equals the bonus token (probability ≈ α^(K+1)) or, with hedges, when a hedge assumed the
rejection that happened (probability ρ given a rejection, learned from the request's
rounds); otherwise the next round drafts afresh. So T(K) = max(V(K), P(K + 1)) + m(K)·D(K):
P the branch call (its rows as passes of at most the draft's batch), m(K) = 1 − α^K·g −
(1 − α^K)·ρ, g ≈ α (a guess is the bonus token). K maximises E(K) / T(K): 0 where a K + 1-token
verify costs several times one (bf16 on AVX2 only), or the draft is nearly as slow as the target.

Under load, C sessions share a service. In lockstep, a round's verify is then one batched
pass over every session's K + 1 tokens (in ⌈C / max batch⌉ passes where C is larger), and
each draft step one batched pass over every session's token: `RoundCosts.at_load` costs
both from the services' batched calibration (Info.calibrated_batch_ms). The sessions all
commit E(K) per round, so the K that maximises one session's E(K) / T(K) maximises the
aggregate too, and K = 0 wins where a batch of C·(K + 1) tokens costs more than E(K) batches
of C. A request whose K may follow the load (greedy, or unseeded) is costed at the sessions
its replicas hold as each round starts, recorded in its stats (`sessions_per_round`); a
seeded sampled request is costed as if alone, so that its seed keeps one output.

Pipelined rounds overlap only for a session alone on its target replica; one costed beside
others is costed, and run, as a sequential round (no pre-draft, no catch-up step). The others'
verifies keep the target busy while any one session drafts, so hiding that session's draft
behind its own verify saves the target no time: its verify waits for their passes instead, and
its pre-drafts that miss take steps of a draft they may share. Emulated, 32 clients on four
target replicas and one draft ran pipelined at 0.94× sequential when every round pre-drafted,
and at 0.99-1.00× this way; one client still gains 1.11× (docs/design.md, "Pipelining").

Where both models compute on one machine's cores (`shared_host`), they take turns on them and
the host is costed as one server: at load C, S_{C−1} + V(K) + D(K) to commit C − 1 + E(K)
tokens against C in S_C; no probes and no copies for a request that starts under load there
(docs/design.md, "The K chooser", one machine's cores, with what was measured).

Pure functions of measured figures: no gRPC, no clocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.engine.costs import cost_at
from specdec.sampling.tree_sampling import MAX_TREE_NODES

TREE_WIDTHS = (2, 3)  # tree shapes the chooser weighs: w children at the root, then chains


def expected_tree_tokens(alpha: float, beta: float, width: int, depth: int) -> float:
    """Tokens a round of the tree (width, 1, …, 1) commits: the root's first child is accepted
    with probability α and, after it is rejected, each further child with probability β; below
    the accepted child, a chain of depth − 1 accepts geometrically with α. Width 1 is the chain."""
    root = 1.0 - (1.0 - alpha) * (1.0 - beta) ** (width - 1)
    return 1.0 + root * expected_tokens(alpha, depth - 1)


def tree_shape(width: int, depth: int) -> tuple[int, ...]:
    """GenerateRequest.tree_widths of the tree (width, 1, …, 1) of this depth."""
    return (width,) + (1,) * (depth - 1)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round: accepted drafts plus the recovered or bonus token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class BatchCosts:
    """A service's passes over several sessions at once, as its Info reports them."""

    single_ms: tuple[float, ...]  # [n - 1]: one session, n new tokens
    batch_ms: tuple[tuple[int, int, float], ...] = ()  # (sessions, new tokens each, ms); empty: not measured
    max_batch: int = 1

    def pass_ms(self, sessions: int, new_tokens: int) -> float:
        """One pass over `sessions` sessions with `new_tokens` new tokens each: interpolated
        linearly in sessions between the measured sizes (one session: the single-session
        costs), and in new tokens between those measured. Unmeasured: one session's pass over
        all the tokens, as an accelerator's cost depends mostly on the tokens in a pass."""
        if sessions <= 1:
            return cost_at(self.single_ms, new_tokens)
        if not self.batch_ms:
            return cost_at(self.single_ms, sessions * new_tokens)
        sizes = sorted({b for b, _, _ in self.batch_ms})
        upper = next((b for b in sizes if b >= sessions), sizes[-1])
        lower = max((b for b in sizes if b < upper), default=1)
        low, high = self._at(lower, new_tokens), self._at(upper, new_tokens)
        return low + (high - low) * (sessions - lower) / (upper - lower)

    def _at(self, sessions: int, new_tokens: int) -> float:
        if sessions == 1:
            return cost_at(self.single_ms, new_tokens)
        points = sorted((n, ms) for b, n, ms in self.batch_ms if b == sessions)
        (n0, ms0), (n1, ms1) = points[0], points[-1]
        if n1 == n0:
            return ms0
        return ms0 + (ms1 - ms0) * (new_tokens - n0) / (n1 - n0)

    def load_ms(self, sessions: int, new_tokens: int) -> float:
        """Serving `sessions` sessions' calls, `new_tokens` each, in passes of at most
        max_batch sessions. Remembered per (sessions, new tokens): the K chooser asks for the
        same few points every round of every request, on the coordinator's one event loop."""
        key = (sessions, new_tokens)
        if key not in self._load_ms:
            passes = math.ceil(max(sessions, 1) / max(self.max_batch, 1))
            self._load_ms[key] = passes * self.pass_ms(math.ceil(max(sessions, 1) / passes), new_tokens)
        return self._load_ms[key]

    @functools.cached_property
    def _load_ms(self) -> dict[tuple[int, int], float]:
        return {}


@dataclass(frozen=True)
class RoundCosts:
    """Milliseconds of the calls a round makes, from measured figures, for a request alone or
    sharing the services with others (`at_load`)."""

    draft_pass_ms: tuple[float, ...]  # [n - 1]: a draft pass over n new tokens
    target_pass_ms: tuple[float, ...]  # [n - 1]: a target pass over n new tokens
    draft_rpc_ms: float = 0.0  # one call's cost outside the model (network, serialisation)
    target_rpc_ms: float = 0.0
    draft_batch: BatchCosts | None = None  # batched passes (None: costed as one pass over their tokens)
    target_batch: BatchCosts | None = None
    draft_sessions: int = 1  # sessions sharing each service in the rounds costed
    target_sessions: int = 1
    shared_host: bool = False  # both models compute on one machine's CPU, taking turns on its cores
    # A pipelined round's branch call (coordinator.overlap): the rows it steps together (the
    # pre-draft, its other bonus guesses, the hedges), and how much likelier the guesses past
    # the first make it that a fully accepted round's pre-draft is kept.
    branch_rows: int = 1
    guess_share: float = 0.0
    # What each row of such a call costs a step beyond the calibrated batched pass (its fork,
    # its sampling, its part of the reply on both ends), learned from earlier calls
    # (coordinator.overlap.RowCost).
    branch_row_ms: float = 0.0
    # The steps a K = 0 round's call runs (coordinator.rounds.steps_per_call), its call's cost
    # shared among them (Choosers.k_chooser sets it; 1: a call a step, as the copy chooser costs).
    target_only_steps: int = 1

    def at_load(self, target_sessions: int, draft_sessions: int) -> RoundCosts:
        """These costs with `target_sessions` and `draft_sessions` sharing the services; this
        very object where those are the ones it has (so what it has worked out, `_ms`, is kept
        from round to round)."""
        target_sessions, draft_sessions = max(target_sessions, 1), max(draft_sessions, 1)
        if (target_sessions, draft_sessions) == (self.target_sessions, self.draft_sessions):
            return self
        return dataclasses.replace(self, target_sessions=target_sessions, draft_sessions=draft_sessions)

    def with_passes(self, target_pass_ms: Sequence[float], draft_pass_ms: Sequence[float] = ()) -> RoundCosts:
        """These one-session pass costs (a service's Info.live_pass_ms) in place of the
        calibrated ones; a list of another length than this one's (a service that reports none)
        leaves that model's as they are. Batched passes keep their calibrated costs."""

        def either(given: Sequence[float], held: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(given) if len(given) == len(held) else held

        target, draft = either(target_pass_ms, self.target_pass_ms), either(draft_pass_ms, self.draft_pass_ms)
        if (target, draft) == (self.target_pass_ms, self.draft_pass_ms):
            return self  # at_load: kept, and what it has worked out with it
        return dataclasses.replace(self, target_pass_ms=target, draft_pass_ms=draft)

    @functools.cached_property
    def _ms(self) -> dict[tuple[str, int], float]:
        """What the calls below have worked out, by (call, tokens): the K chooser asks each
        round for every K up to its largest, several times over, on the coordinator's one event
        loop; these depend only on the (frozen) costs."""
        return {}

    def draft_step_ms(self) -> float:
        if ("step", 1) not in self._ms:
            if self.draft_sessions == 1:
                self._ms["step", 1] = cost_at(self.draft_pass_ms, 1)
            else:
                batch = self.draft_batch or BatchCosts(self.draft_pass_ms)
                self._ms["step", 1] = batch.load_ms(self.draft_sessions, 1)
        return self._ms["step", 1]

    def draft_ms(self, k: int) -> float:
        """K one-token steps (the first also feeds the committed token, counted as one)."""
        return self.draft_rpc_ms + k * self.draft_step_ms() if k else 0.0

    def predraft_ms(self, steps: int) -> float:  # a branch call: its rows stepped together
        if self.branch_rows == 1:
            return self.draft_ms(steps)
        if ("branch", steps) not in self._ms:
            batch = self.draft_batch or BatchCosts(self.draft_pass_ms)
            rows = self.draft_sessions + self.branch_rows - 1
            step_ms = batch.load_ms(rows, 1) + self.branch_rows * self.branch_row_ms
            self._ms["branch", steps] = self.draft_rpc_ms + steps * step_ms
        return self._ms["branch", steps]

    def verify_ms(self, k: int) -> float:
        """A verify of K drafts; at K = 0 a target-only step, its call shared among the call's
        `target_only_steps`."""
        if ("verify", k) not in self._ms:
            rpc_ms = self.target_rpc_ms / (1 if k else max(self.target_only_steps, 1))
            if self.target_sessions == 1:
                self._ms["verify", k] = rpc_ms + cost_at(self.target_pass_ms, k + 1)
            else:
                batch = self.target_batch or BatchCosts(self.target_pass_ms)
                self._ms["verify", k] = rpc_ms + batch.load_ms(self.target_sessions, k + 1)
        return self._ms["verify", k]

    def round_ms(self, k: int, alpha: float, pipelined: bool, rescue: float = 0.0) -> float:
        """`rescue`: with hedges, the chance that a hedge assumed a rejection that happened.
        Pipelined rounds overlap only for a session alone on its target (`overlaps`)."""
        if pipelined and k and self.overlaps:
            guessed = alpha + (1.0 - alpha) * self.guess_share  # the bonus token among the guesses
            return overlapped_ms(
                self.verify_ms(k), self.predraft_ms(k + 1), self.draft_ms(k), alpha, k, guessed, rescue
            )
        return self.verify_ms(k) + self.draft_ms(k)

    @property
    def overlaps(self) -> bool:
        """A pipelined round's pre-draft hides behind its verify only for a session alone on its
        target; beside others, their verifies fill the target while it drafts."""
        return self.target_sessions == 1

    def tokens_per_ms(self, k: int, alpha: float, pipelined: bool, rescue: float = 0.0) -> float:
        """This session's rate; on a shared host under load, the host's (module docstring)."""
        if self.shared_host and self.target_sessions > 1:
            return self.host_tokens_per_ms(k, alpha)
        return expected_tokens(alpha, k) / max(self.round_ms(k, alpha, pipelined, rescue), 1e-9)

    def rates(self, alpha: float, k_max: int, pipelined: bool, rescue: float = 0.0) -> list[float]:
        """[k_max + 1]: `tokens_per_ms` of every K from 0, the same figures worked out in one
        pass: the K chooser asks for all of them two or three times a round, and call by call
        they cost a twentieth of a millisecond a round on the coordinator's event loop."""
        if self.shared_host and self.target_sessions > 1:
            return [self.host_tokens_per_ms(k, alpha) for k in range(k_max + 1)]
        verify, draft, predraft = self._rows(k_max)
        overlapped = pipelined and self.overlaps
        guessed = alpha + (1.0 - alpha) * self.guess_share  # round_ms's, for every K
        rates = []
        for k in range(k_max + 1):
            if overlapped and k:
                ms = overlapped_ms(verify[k], predraft[k], draft[k], alpha, k, guessed, rescue)
            else:
                ms = verify[k] + draft[k]
            rates.append(expected_tokens(alpha, k) / max(ms, 1e-9))
        return rates

    @functools.cached_property
    def _rows_by_k_max(self) -> dict[int, tuple[list[float], list[float], list[float]]]:
        return {}

    def _rows(self, k_max: int) -> tuple[list[float], list[float], list[float]]:
        """[k_max + 1] each, by K: verify_ms(K), draft_ms(K) and predraft_ms(K + 1), kept."""
        rows = self._rows_by_k_max.get(k_max)
        if rows is None:
            ks = range(k_max + 1)
            verify, draft = [self.verify_ms(k) for k in ks], [self.draft_ms(k) for k in ks]
            rows = verify, draft, [self.predraft_ms(k + 1) for k in ks]
            self._rows_by_k_max[k_max] = rows
        return rows

    def host_tokens_per_ms(self, k: int, alpha: float) -> float:
        """Tokens the shared host commits per millisecond while the other sessions step and this
        one drafts K (module docstring): C / S_C at K = 0, else (C − 1 + E(K)) / (S_{C−1} +
        V(K) + D(K)), its draft call and its verify alone, pipelined or not: on shared cores
        nothing overlaps."""
        sessions = self.target_sessions
        if not k:
            return sessions / max(self.verify_ms(0), 1e-9)
        others_ms = self.at_load(sessions - 1, self.draft_sessions).verify_ms(0)
        own_ms = self.at_load(1, 1).round_ms(k, alpha, pipelined=False)  # the others are not drafting
        return (sessions - 1 + expected_tokens(alpha, k)) / max(others_ms + own_ms, 1e-9)

    def tree_round_ms(self, width: int, depth: int) -> float:
        """A sequential round of the tree (width, 1, …, 1): the root's pass, then depth − 1
        level passes over `width` nodes each (the last level runs none), and one verify over
        the root and width · depth nodes."""
        draft = self.draft_rpc_ms + cost_at(self.draft_pass_ms, 1) + (depth - 1) * cost_at(self.draft_pass_ms, width)
        return draft + self.target_rpc_ms + cost_at(self.target_pass_ms, width * depth + 1)


def overlapped_ms(
    verify_ms: float, predraft_ms: float, draft_ms: float, alpha: float, k: int, guessed: float, rescue: float
) -> float:
    """A pipelined round alone on its target (RoundCosts.round_ms): the verify and the next
    round's pre-draft side by side, and a fresh draft where the pre-draft is not kept: not
    every draft accepted with the bonus token among the guesses, nor a rejection a hedge
    assumed (`guessed`: that chance for the bonus token; `rescue`: for a rejection)."""
    miss = 1.0 - alpha**k * guessed - (1.0 - alpha**k) * rescue
    return max(verify_ms, predraft_ms) + miss * draft_ms


def best_k(alpha: float, costs: RoundCosts, k_max: int, pipelined: bool, k_min: int = 0, rescue: float = 0.0) -> int:
    """argmax over K in [k_min, k_max] of expected tokens per millisecond (ties: smaller K)."""
    rates = costs.rates(alpha, k_max, pipelined, rescue)
    return max(range(k_min, k_max + 1), key=lambda k: (rates[k], -k))


def best_tree(alpha: float, beta: float, costs: RoundCosts, k_max: int) -> tuple[tuple[int, ...], float]:
    """The tree (width, 1, …, 1) of width in TREE_WIDTHS and depth 1..k_max (at most
    MAX_TREE_NODES nodes) with the most expected tokens per millisecond, and that rate."""
    candidates = [
        (expected_tree_tokens(alpha, beta, width, depth) / max(costs.tree_round_ms(width, depth), 1e-9), width, depth)
        for width in TREE_WIDTHS
        for depth in range(1, k_max + 1)
        if width * depth <= MAX_TREE_NODES
    ]
    if not candidates:
        return (), 0.0
    rate, width, depth = max(candidates, key=lambda c: (c[0], -c[1] * c[2]))
    return tree_shape(width, depth), rate
