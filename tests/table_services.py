"""In-process draft and target services whose models are lookup tables, for the coordinator's
high-power distribution tests (tests/heavy/test_mode_distributions.py).

Why not the real services: a χ² test that detects a total-variation distance of 0.02 at
p < 1e-4 needs tens of thousands of generations per case, and the real services cost about
12 ms a generation on two cores (tiny transformer passes, batching, protobuf over in-process
channels). These doubles keep what the coordinator's exactness rests on and nothing else:

- each "model" gives every context a fixed next-token distribution over a few tokens, so the
  target's distribution over whole continuations is known exactly;
- the draft answers Propose and ProposeBranches with the real session rules (specdec.engine.sessions:
  keep_tokens, forks, epochs), draws each token by inverse CDF from a generator seeded
  with the call's seed (Python's Mersenne Twister: seeding numpy's generator cost a tenth of
  these tests' time), sends the distribution it drew from (dense, on the wire), the runner-up
  the hedges plan from, and stops on confidence with the real rule (draft_service.runner's
  `stops_on_confidence`);
- the target answers Verify as the real one does (specdec.sampling.probs.verify_outputs's contract):
  the probability of each draft token, a recovered sample from the residual at every
  position and the bonus sample, all from the call's seed.

The real services' own math is tested against these same properties with real models over
real and in-process gRPC (test_distribution.py, test_runners.py); here the subject is the
coordinator: its rounds, pre-drafts, hedges, K chooser and seed streams.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import numpy as np

from draft_service.drafter import stops_on_confidence
from specdec.engine.costs import CALIBRATION_CONTEXT
from specdec.engine.sessions import SessionStore
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, target_pb2

MAX_SPECULATIVE_TOKENS = 8
ONE_HOT = common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())  # a guess: compared, never verified


@dataclass
class TableModel:
    """A fixed next-token distribution per context: logits drawn once per context from a
    generator keyed by (salt, context). A draft is made from its target (`base`) by adding
    `noise` to the target's logits, so the two mostly agree, as a real pair does."""

    vocab_size: int
    salt: int
    logit_scale: float = 1.5
    base: TableModel | None = None
    noise: float = 0.0
    _logits: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    _rows: dict[tuple[int, ...], Row] = field(default_factory=dict)

    def row(self, context: tuple[int, ...]) -> Row:
        row = self._rows.get(context)
        if row is None:
            logits = self.logits(context)
            probs = np.exp(logits - logits.max())
            row = self._rows[context] = row_of(probs / probs.sum())
        return row

    def probs(self, context: tuple[int, ...]) -> np.ndarray:  # [V] float64, sums to 1
        return self.row(context).probs

    def logits(self, context: tuple[int, ...]) -> np.ndarray:  # [V]
        logits = self._logits.get(context)
        if logits is None:
            rng = np.random.default_rng((self.salt, len(context), *context))
            if self.base is None:
                logits = rng.normal(0.0, self.logit_scale, self.vocab_size)
            else:
                logits = self.base.logits(context) + rng.normal(0.0, self.noise, self.vocab_size)
            self._logits[context] = logits
        return logits

    def continuations(self, prompt: tuple[int, ...], length: int) -> dict[tuple[int, ...], float]:
        """Probability of every `length`-token continuation of `prompt` (no EOS)."""
        probs: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(length):
            probs = {
                prefix + (token,): prefix_prob * float(token_prob)
                for prefix, prefix_prob in probs.items()
                for token, token_prob in enumerate(self.probs(prompt + prefix))
            }
        return probs


def draw(cdf: np.ndarray, generator: random.Random) -> int:
    """Inverse CDF, as specdec.sampling.probs.sample draws: token i when cdf[i-1] <= u < cdf[i], so a
    token of probability 0 (an empty interval) is never drawn. cdf: [V], ending at 1."""
    return min(int(cdf.searchsorted(generator.random() * cdf[-1], side="right")), cdf.size - 1)


@dataclass(frozen=True)
class Row:
    """One context's distribution, with what the doubles derive from it, computed once."""

    probs: np.ndarray  # [V] float64
    cdf: np.ndarray  # [V]
    wire: common_pb2.ProposalDistribution  # dense float32, as the draft sends it
    order: tuple[int, ...]  # every token, likeliest first

    @property
    def argmax(self) -> int:
        return self.order[0]

    def runner_ups(self, token: int, count: int) -> list[int]:
        """The `count` likeliest tokens other than `token`, best first (ProposeResponse)."""
        return [other for other in self.order[: count + 1] if other != token][:count]


def row_of(probs: np.ndarray) -> Row:
    sent = probs.astype("<f4")
    order = np.argsort(-probs, kind="stable")
    return Row(
        probs,
        np.cumsum(probs),
        common_pb2.ProposalDistribution(dense=common_pb2.DenseProbs(float32_le=sent.tobytes())),
        tuple(int(token) for token in order),
    )


class TableService:
    """What both doubles share: the client surface the coordinator uses (specdec clients'
    info/end_session/close) and Info with the calibrated costs the K chooser reads."""

    role = ""

    def __init__(
        self, model: TableModel, fingerprint: str, pass_ms: tuple[float, ...] = (), max_batch_size: int = 0
    ) -> None:
        self.model = model
        self.max_batch_size = max_batch_size  # in Info: sessions one pass may step (0: not said)
        self.address = f"table {self.role}"
        self.timeout_s = 30.0
        self.fingerprint = fingerprint
        self.pass_ms = pass_ms
        self.sessions = SessionStore(max_sessions=100_000, ttl_s=600.0, cache_factory=lambda: None)

    async def info(self, timeout_s: float | None = None) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model_id=f"table-{self.role}",
            vocab_size=self.model.vocab_size,
            tokenizer_fingerprint=self.fingerprint,
            max_context=4096,
            max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
            calibrated_pass_ms=list(self.pass_ms),
            cost_context_tokens=CALIBRATION_CONTEXT,
            max_batch_size=self.max_batch_size,
        )

    async def wait_info(self, total_timeout_s: float) -> common_pb2.ModelInfo:
        return await self.info()

    async def end_session(
        self, session_id: str, discard: bool = False, epoch: int = 0, committed: int | None = None
    ) -> None:
        self.sessions.retire(session_id, epoch)
        self.sessions.end(session_id)

    async def serving(self, timeout_s: float = 1.0) -> bool:
        return True

    unended = 0  # ServiceClient's: every EndSession here is answered

    def forget_unended(self, session_id: str) -> None:
        pass

    async def close(self) -> None:
        pass

    @property
    def open_sessions(self) -> int:
        return len(self.sessions.ids())


class TableDraft(TableService):
    role = "draft"

    def __init__(self, *args, min_confidence: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_confidence = min_confidence
        self.confidence_stops = 0

    async def propose(self, request: draft_pb2.ProposeRequest, allowance_s: float = 0.0) -> draft_pb2.ProposeResponse:
        await asyncio.sleep(0)  # a real call yields to the event loop; so do the branches
        return self._propose(request)

    async def propose_branches(self, request: draft_pb2.ProposeBranchesRequest) -> draft_pb2.ProposeBranchesResponse:
        await asyncio.sleep(0)
        named = {b.session_id for b in request.branches} | {b.fork_from for b in request.branches}
        assert not named & set(request.end_session_ids), "a call may not end a session its branches use"
        for session_id in request.end_session_ids:  # ended first, as the real service does
            self.sessions.end(session_id)
        results = []
        for branch in request.branches:
            try:
                results.append(draft_pb2.BranchResult(proposal=self._propose(branch)))
            except Exception as exc:  # noqa: BLE001 - per branch, as the real service reports them
                results.append(draft_pb2.BranchResult(error_code=5, error_message=str(exc)))
        return draft_pb2.ProposeBranchesResponse(results=results)

    def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        params = wire.params_from_pb(request.sampling)
        assert params == SamplingParams(temperature=1.0), "the tables hold temperature-1 distributions only"
        session = self.sessions.for_call(request.session_id, request.keep_tokens, request.epoch, request.fork_from)
        session.extend(request.keep_tokens, list(request.new_tokens))
        min_confidence = request.min_confidence if request.HasField("min_confidence") else self.min_confidence
        generator = random.Random(request.seed)
        response = draft_pb2.ProposeResponse()
        for step in range(request.num_tokens):
            row = self.model.row(tuple(session.tokens))
            guess = request.guess_first and not step  # the argmax (or runner-up), sent one-hot, no draw
            token = row.order[min(request.guess_rank, len(row.order) - 1)] if guess else draw(row.cdf, generator)
            response.token_ids.append(token)
            response.distributions.append(ONE_HOT if guess else row.wire)
            for runner_up in row.runner_ups(token, max(request.runner_ups, 1)):
                response.runner_up_token_ids.append(runner_up)
                response.runner_up_probs.append(float(row.probs[runner_up]))
            session.tokens.append(token)
            if stops_on_confidence(float(row.probs[token]), min_confidence, guess and request.guess_rank > 0):
                self.confidence_stops += 1
                break
        response.sequence_length = len(session.tokens)
        return response


class TableTarget(TableService):
    role = "target"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._residuals: dict[tuple[tuple[int, ...], bytes], np.ndarray] = {}

    async def verify(self, request: target_pb2.VerifyRequest, allowance_s: float = 0.0) -> target_pb2.VerifyResponse:
        await asyncio.sleep(0)
        draft_ids = list(request.draft_token_ids)
        session = self.sessions.open(request.session_id, request.keep_tokens)
        session.extend(request.keep_tokens, list(request.new_tokens) + draft_ids)
        base = len(session.tokens) - len(draft_ids)
        generator = random.Random(request.seed)
        response = target_pb2.VerifyResponse(sequence_length=len(session.tokens))
        # As specdec.sampling.probs.verify_outputs: a recovered sample at every position, then the bonus,
        # so the target's draws do not depend on the coordinator's coins.
        for position, (token, sent) in enumerate(zip(draft_ids, request.draft_distributions)):
            context = tuple(session.tokens[: base + position])
            target_row = self.model.row(context)
            response.draft_token_target_probs.append(float(target_row.probs[token]))
            response.recovered_token_ids.append(draw(self._residual_cdf(context, sent.dense), generator))
        response.bonus_token_id = draw(self.model.row(tuple(session.tokens)).cdf, generator)
        # A target-only call's further steps (VerifyRequest.step_seeds): each draws as a call of
        # its own with that seed would; the session holds every token but the last.
        token = response.bonus_token_id
        for seed in request.step_seeds:
            if token in request.stop_token_ids:
                break
            session.extend(len(session.tokens), [token])
            token = draw(self.model.row(tuple(session.tokens)).cdf, random.Random(seed))
            response.step_token_ids.append(token)
        response.sequence_length = len(session.tokens)
        return response

    def _residual_cdf(self, context: tuple[int, ...], dense: common_pb2.DenseProbs) -> np.ndarray:
        """cdf of norm(max(0, target_probs - draft_probs)), or of target_probs where that is
        empty (specdec.sampling.probs.residual_probs), for the draft distribution sent as `dense`."""
        key = (context, dense.float32_le)
        cdf = self._residuals.get(key)
        if cdf is None:
            target_probs = self.model.probs(context)
            residual = np.clip(target_probs - wire.decode_dense(dense), 0.0, None)
            cdf = self._residuals[key] = np.cumsum(residual if residual.sum() > 1e-7 else target_probs)
        return cdf
