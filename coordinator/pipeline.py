"""The generation loop: draft proposes, target verifies, the coordinator accepts or rejects.

Each round sends each service only what it has not seen: the service keeps the session's
sequence and KV cache, and the coordinator tracks how much of it is still valid (`synced`).
A service that lost the session (restart, expiry) answers NOT_FOUND and is re-sent the
whole committed sequence, so no request fails because of it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.sampling import decide_round
from coordinator.text import FINISH_LENGTH, TextAssembler
from specdec import wire
from specdec.errors import InvalidArgument, SessionNotFound, SpecDecError
from specdec.probs import SamplingParams
from specdec.v1 import draft_pb2, target_pb2

logger = logging.getLogger(__name__)

_SEED_BOUND = 2**63


@dataclass(frozen=True)
class GenerationRequest:
    """A client request as the domain sees it (fields as in GenerateRequest; None = unset)."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None


@dataclass(frozen=True)
class PairInfo:
    """What start-up learned from both services' Info."""

    vocab_size: int  # ids valid for both models
    eos_token_ids: frozenset[int]
    max_context: int  # the target's
    draft_max_context: int
    max_num_speculative_tokens: int  # the config's maximum, capped by both services'


@dataclass(frozen=True)
class Job:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...]
    num_speculative_tokens: int


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class _SessionView:
    """The coordinator's record of one service's session."""

    session_id: str
    synced: int = 0  # leading tokens of the committed sequence the service holds
    opened: bool = False


@dataclass
class _Round:
    draft_token_ids: list[int] = field(default_factory=list)
    draft_token_draft_probs: list[float] = field(default_factory=list)
    distributions: list = field(default_factory=list)


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        draft: DraftClient,
        target: TargetClient,
        tokenizer: PreTrainedTokenizerBase,
        pair: PairInfo,
    ) -> None:
        self.config = config
        self.draft = draft
        self.target = target
        self.tokenizer = tokenizer
        self.pair = pair
        self._cleanup: set[asyncio.Task] = set()

    def prepare(self, request: GenerationRequest) -> Job:
        """Validates a request; every failure says what was wrong and what is accepted."""
        config, pair = self.config, self.pair
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("set exactly one of prompt and prompt_token_ids; both were set")
        if request.prompt:
            prompt_ids = list(self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
            if not prompt_ids:
                raise InvalidArgument("prompt encodes to no tokens; send non-empty text")
        elif request.prompt_token_ids:
            prompt_ids = list(request.prompt_token_ids)
            for i, token in enumerate(prompt_ids):
                if not 0 <= token < pair.vocab_size:
                    raise InvalidArgument(
                        f"prompt_token_ids[{i}] = {token} is outside the vocabulary; ids must be in [0, {pair.vocab_size})"
                    )
        else:
            raise InvalidArgument("prompt is empty: set prompt (text) or prompt_token_ids")
        if len(prompt_ids) >= pair.max_context:
            raise InvalidArgument(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {pair.max_context}, "
                f"so at most {pair.max_context - 1} prompt tokens are accepted"
            )
        max_new_tokens = config.default_max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}]; got {max_new_tokens}")
        if not math.isfinite(request.temperature) or request.temperature < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy); got {request.temperature}")
        if request.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 = off); got {request.top_k}")
        top_p = 1.0 if request.top_p is None else request.top_p
        if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1] (1.0 = off); got {top_p}")
        if request.num_speculative_tokens is None:
            # The configured default, within what both services accept.
            k = min(config.default_num_speculative_tokens, pair.max_num_speculative_tokens)
        else:
            k = request.num_speculative_tokens
        if not 0 <= k <= pair.max_num_speculative_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {pair.max_num_speculative_tokens}] (0 = target only); got {k}"
            )
        if len(request.stop) > config.max_stop_strings:
            raise InvalidArgument(f"stop has {len(request.stop)} strings; at most {config.max_stop_strings} are accepted")
        for stop in request.stop:
            if not 0 < len(stop) <= config.max_stop_string_chars:
                raise InvalidArgument(
                    f"stop strings must have 1 to {config.max_stop_string_chars} characters; got one of {len(stop)}"
                )
        seed = secrets.randbits(63) if request.seed is None else request.seed
        return Job(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            params=SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=top_p),
            seed=seed,
            stop=tuple(request.stop),
            num_speculative_tokens=k,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Yields one chunk per round; the last carries the finish reason and the stats."""
        job = self.prepare(request)
        stats = GenerationStats(prompt_tokens=len(job.prompt_ids))
        rng = np.random.default_rng(job.seed)
        session_id = uuid.uuid4().hex
        draft_view, target_view = _SessionView(session_id), _SessionView(session_id)
        sampling = wire.params_to_pb(job.params)
        sequence = list(job.prompt_ids)
        text = TextAssembler(self.tokenizer, job.prompt_ids, set(self.pair.eos_token_ids), job.stop, job.max_new_tokens)
        try:
            while True:
                room = self.pair.max_context - len(sequence)
                remaining = job.max_new_tokens - len(text.token_ids)
                k = max(0, min(job.num_speculative_tokens, remaining - 1, room - 1, self.pair.draft_max_context - len(sequence)))
                draft_seed, target_seed = (int(s) for s in rng.integers(0, _SEED_BOUND, size=2))
                uniforms = rng.random(k).tolist()  # [K]
                round_ = _Round()
                if k:
                    proposal = await self._propose(draft_view, sequence, k, sampling, draft_seed, stats)
                    if len(proposal.token_ids) > k:
                        raise SpecDecError(
                            f"service at {self.draft.address} proposed {len(proposal.token_ids)} tokens for K={k}; the reply is malformed"
                        )
                    _check_reply(self.draft.address, "distributions", len(proposal.distributions), len(proposal.token_ids))
                    stats.draft_compute_ms += proposal.compute_ms
                    round_ = _Round(
                        list(proposal.token_ids),
                        [wire.token_probability(d, t) for d, t in zip(proposal.distributions, proposal.token_ids)],
                        list(proposal.distributions),
                    )
                # A drafter may propose fewer than K (a prompt lookup with no match proposes none).
                proposed = len(round_.draft_token_ids)
                verification = await self._verify(target_view, sequence, round_, sampling, target_seed, stats)
                _check_reply(self.target.address, "draft_token_target_probs", len(verification.draft_token_target_probs), proposed)
                _check_reply(self.target.address, "recovered_token_ids", len(verification.recovered_token_ids), proposed)
                stats.target_compute_ms += verification.compute_ms
                outcome = decide_round(
                    verification.draft_token_target_probs,
                    round_.draft_token_draft_probs,
                    uniforms[:proposed],
                    verification.recovered_token_ids,
                    verification.bonus_token_id,
                )
                stats.record_round(proposed, outcome.num_accepted)
                # Both services hold sequence + drafts; only the accepted drafts stay valid.
                target_view.synced = len(sequence) + outcome.num_accepted
                if k:
                    draft_view.synced = len(sequence) + outcome.num_accepted
                finished = False
                for token in outcome.committed(round_.draft_token_ids):
                    sequence.append(token)
                    if finished := text.push(token):
                        break
                if not finished and len(sequence) >= self.pair.max_context:
                    text.finish(FINISH_LENGTH)
                stats.mark_first_token()
                delta = text.take_delta()
                if text.finish_reason is not None:
                    stats.close(len(text.token_ids))
                    yield Chunk(delta.token_ids, delta.text, text.finish_reason, stats)
                    return
                yield Chunk(delta.token_ids, delta.text)
        finally:
            self._end_sessions(draft_view, target_view)

    async def _propose(
        self, view: _SessionView, sequence: list[int], k: int, sampling, seed: int, stats: GenerationStats
    ) -> draft_pb2.ProposeResponse:
        def send(keep: int, new_tokens: list[int]):
            return self.draft.propose(
                draft_pb2.ProposeRequest(
                    session_id=view.session_id, keep_tokens=keep, new_tokens=new_tokens,
                    num_tokens=k, sampling=sampling, seed=seed,
                )
            )

        return await self._with_reprefill("draft", view, sequence, stats, send)

    async def _verify(
        self, view: _SessionView, sequence: list[int], round_: _Round, sampling, seed: int, stats: GenerationStats
    ) -> target_pb2.VerifyResponse:
        def send(keep: int, new_tokens: list[int]):
            return self.target.verify(
                target_pb2.VerifyRequest(
                    session_id=view.session_id, keep_tokens=keep, new_tokens=new_tokens,
                    draft_token_ids=round_.draft_token_ids, draft_distributions=round_.distributions,
                    sampling=sampling, seed=seed,
                )
            )

        return await self._with_reprefill("target", view, sequence, stats, send)

    async def _with_reprefill(self, role: str, view: _SessionView, sequence: list[int], stats: GenerationStats, send):
        """Sends only the unseen tail; if the service lost the session, re-sends everything once."""
        for attempt in range(2):
            view.opened = True  # even a failed call may have opened it; ending is idempotent
            started = stats.elapsed_ms()
            try:
                return await send(view.synced, sequence[view.synced :])
            except SessionNotFound:
                if attempt:
                    raise SpecDecError(f"{role} service lost session {view.session_id} again right after a full re-send") from None
                logger.info("%s lost session %s; re-sending %d tokens", role, view.session_id, len(sequence))
                stats.reprefills += 1
                view.synced = 0
            finally:
                elapsed = stats.elapsed_ms() - started
                if role == "draft":
                    stats.draft_ms += elapsed
                else:
                    stats.target_ms += elapsed
        raise AssertionError("unreachable")

    def _end_sessions(self, *views: _SessionView) -> None:
        """Frees the services' sessions without delaying (or being cancelled with) the request."""
        clients = (self.draft, self.target)
        for client, view in zip(clients, views):
            if view.opened:
                task = asyncio.get_running_loop().create_task(client.end_session(view.session_id))
                self._cleanup.add(task)
                task.add_done_callback(self._cleanup.discard)


def _check_reply(address: str, field_name: str, got: int, expected: int) -> None:
    """A node that answers with the wrong shape fails the request; it never corrupts output."""
    if got != expected:
        raise SpecDecError(f"service at {address} returned {got} {field_name} for K={expected}; the reply is malformed")
