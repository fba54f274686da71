"""The coordinator's calls to the draft and target services: deadlines and retries, the
circuit breaker with its health probe, re-sending the sequence to a service that lost the
session, the pair's Info read again when a restarted draft refuses a call, and ending
sessions without delaying the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar

from opentelemetry import trace

from coordinator.breaker import CircuitBreaker
from coordinator.clients import CallRejected, DraftClient, TargetClient, check_pair
from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo, pair_info
from coordinator.state import Round, SessionView, Source, round_from
from specdec.errors import DeadlineExceeded, ResourceExhausted, SessionNotFound, SpecDecError, Unavailable
from specdec.v1 import common_pb2, draft_pb2, target_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def retry_unavailable(
    call: Callable[[], Awaitable[T]],
    give_up: Callable[[int], bool],
    backoff_s: float,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """Awaits `call()`, again after backoff_s · 2^(n−1) seconds (at most 1 s) each time it
    raises Unavailable, until `give_up(attempts so far)`; a missed deadline is never retried.
    A plain loop: it runs on every round, where a retry library's per-call set-up cost a
    tenth of the coordinator's own time per round."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return await call()
        except Unavailable as exc:
            if isinstance(exc, DeadlineExceeded) or give_up(attempts):
                raise
        await asyncio.sleep(min(backoff_s * 2 ** (attempts - 1), 1.0))
        if on_retry is not None:
            on_retry()


REREAD_WAIT_S = 0.5  # how long a request whose draft call was rejected waits for the draft's Info


class Upstream:
    """The draft and target as the round loop sees them: one object shared by every request,
    holding the clients, the draft's circuit breaker and the pair's current Info."""

    def __init__(
        self,
        config: CoordinatorConfig,
        draft: DraftClient,
        target: TargetClient,
        pair: PairInfo,
        target_info: common_pb2.ModelInfo,
    ) -> None:
        self.config = config
        self.draft = draft
        self.target = target
        self.pair = pair  # replaced (never changed in place) when a restarted draft's Info differs;
        # a request keeps the one it began with (RequestState.pair) until the draft rejects a call
        self._target_info = target_info  # to rebuild the pair when the draft changes
        # Shared by all requests: a dead draft costs one request its retries, not every round of every request.
        self.breaker = CircuitBreaker(config.breaker_failures)
        self._cleanup: set[asyncio.Task] = set()
        self._probe: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None

    def close(self) -> None:
        for task in (self._probe, self._refresh):
            if task is not None:
                task.cancel()

    def round_from(self, proposal: draft_pb2.ProposeResponse, k: int, source: Source = Source.DRAFT) -> Round:
        """The drafts of a Propose reply, or a branch's, checked against what was asked: the one
        place a draft's reply becomes a round's drafts."""
        return round_from(proposal, k, self.draft.address, self.pair.vocab_size, source)

    async def propose(
        self,
        view: SessionView,
        sequence: list[int],
        k: int,
        sampling,
        seed: int,
        stats: GenerationStats,
        pair: PairInfo,
        max_copied: int | None = None,
        tree_widths: tuple[int, ...] = (),
    ) -> draft_pb2.ProposeResponse:
        """A round's draft call, retried on UNAVAILABLE (a restarting draft, a dropped
        connection) but never on a missed deadline: a slow draft is skipped, not waited for.
        `pair`: the request's snapshot of the pair (the draft's vocabulary width).
        `max_copied`: ProposeRequest.max_copied_tokens for a draft that copies (k may then be
        0); None leaves it unset. `tree_widths`: propose a tree instead (k 0)."""

        def send(keep: int, new_tokens: list[int]):
            view.last_epoch = next(view.calls)
            request = draft_pb2.ProposeRequest(
                session_id=view.session_id,
                keep_tokens=keep,
                new_tokens=pair.for_draft(new_tokens),
                num_tokens=k,
                sampling=sampling,
                seed=seed,
                epoch=view.last_epoch,
                tree_widths=tree_widths,
                **view.draft_fields(),
            )
            if max_copied is not None:  # unset means num_tokens
                request.max_copied_tokens = max_copied
            return self.draft.propose(request)

        return await retry_unavailable(
            lambda: self._with_reprefill("draft", view, sequence, stats, send),
            give_up=lambda attempts: attempts >= self.config.draft_attempts,
            backoff_s=self.config.draft_retry_backoff_s,
        )

    def draft_failed(self, exc: SpecDecError, draft_view: SessionView, stats: GenerationStats) -> None:
        """Counts a failed draft call, opens the breaker after enough of them, and forgets what
        the draft held: if it comes back, the next call re-sends the whole sequence. A draft
        that rejected the call may have restarted with other capabilities (no copies, no
        trees, a lower K): its Info is read again. One that cannot hold the request
        (RESOURCE_EXHAUSTED) counts for this request only, not for the breaker."""
        if isinstance(exc, CallRejected) and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_pair())
        stats.draft_failures += 1
        draft_view.synced = 0
        trace.get_current_span().add_event("fallback", {"specdec.reason": str(exc)[:200]})
        if isinstance(exc, ResourceExhausted):
            # The draft cannot hold this request (its KV budget, its session limit) and the
            # target can; the draft node is fine, so the breaker other requests share is untouched.
            logger.info("draft refused the request, which runs target-only rounds before asking again: %s", exc)
            return
        logger.warning("draft call failed, round runs target-only: %s", exc)
        if self.breaker.record_failure():
            logger.warning(
                "draft at %s failed %d times in a row: rounds run target-only until a health probe finds it serving",
                self.draft.address,
                self.breaker.failure_threshold,
            )
            if self._probe is None or self._probe.done():
                self._probe = asyncio.get_running_loop().create_task(self._probe_draft())

    async def reread_pair(self) -> PairInfo:
        """The pair once the Info read that a rejected call started has finished; the pair as
        it was where the draft is unreachable, no longer pairs, or has not answered within
        REREAD_WAIT_S (the read goes on, and a later rejection takes its result): the round
        that waits runs target-only anyway, and a draft must never hold a request up."""
        if self._refresh is not None and not self._refresh.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._refresh), REREAD_WAIT_S)
            except TimeoutError:
                pass
        return self.pair

    async def _refresh_pair(self) -> None:
        """Rebuilds the pair from the draft's Info as it is now; keeps it where the draft is
        unreachable or no longer pairs with the target (the breaker then keeps rounds
        target-only). The chooser's costs stay as measured at start-up (a seed's output does
        not move with a draft restart; a coordinator restart re-measures)."""
        try:
            draft_info = await self.draft.info()
            check_pair(
                draft_info,
                self._target_info,
                self._target_info.tokenizer_fingerprint,
                self.draft.address,
                self.target.address,
            )
        except SpecDecError as exc:
            logger.warning("draft at %s refused a call and its Info does not pair: %s", self.draft.address, exc)
            return
        refreshed = pair_info(self.config, draft_info, self._target_info, self.pair.costs)
        if refreshed != self.pair:
            logger.warning(
                "draft at %s changed (copies %s -> %s, trees %s -> %s, max K %d -> %d): rounds follow its new Info",
                self.draft.address,
                self.pair.draft_copies,
                refreshed.draft_copies,
                self.pair.trees,
                refreshed.trees,
                self.pair.max_num_speculative_tokens,
                refreshed.max_num_speculative_tokens,
            )
            self.pair = refreshed

    async def _probe_draft(self) -> None:
        """While the breaker is open, asks the draft's health service until it is SERVING."""
        while self.breaker.is_open:
            await asyncio.sleep(self.config.breaker_probe_interval_s)
            if await self.draft.serving():
                logger.info("draft at %s is serving again: speculation resumes", self.draft.address)
                self.breaker.close()

    async def verify(
        self,
        view: SessionView,
        sequence: list[int],
        round_: Round,
        sampling,
        seed: int,
        stats: GenerationStats,
        retry_until: float,
        step_seeds: Sequence[int] = (),
        stop_token_ids: Collection[int] = (),
    ) -> target_pb2.VerifyResponse:
        """The round's verify (a target-only one with `step_seeds`: its further steps, stopping
        after a token in `stop_token_ids`). A target that is UNAVAILABLE (restarting) is
        retried until `retry_until` (loop time); back up, it has lost the session, answers
        NOT_FOUND and is re-sent the committed sequence, so the output does not change."""

        def send(keep: int, new_tokens: list[int]):
            return self.target.verify(
                target_pb2.VerifyRequest(
                    session_id=view.session_id,
                    keep_tokens=keep,
                    new_tokens=new_tokens,
                    draft_token_ids=round_.draft_token_ids,
                    draft_distributions=round_.distributions,
                    draft_parents=round_.parents,
                    sampling=sampling,
                    seed=seed,
                    step_seeds=step_seeds,
                    stop_token_ids=sorted(stop_token_ids),
                )
            )

        loop = asyncio.get_running_loop()

        def retried() -> None:
            stats.target_retries += 1

        return await retry_unavailable(
            lambda: self._with_reprefill("target", view, sequence, stats, send),
            give_up=lambda attempts: loop.time() >= retry_until,
            backoff_s=0.1,
            on_retry=retried,
        )

    async def _with_reprefill(self, role: str, view: SessionView, sequence: list[int], stats: GenerationStats, send):
        """Sends only the unseen tail; if the service lost the session, re-sends everything once."""
        for attempt in range(2):
            view.opened = True  # even a failed call may have opened it; ending is idempotent
            started = stats.elapsed_ms()
            try:
                return await send(view.synced, sequence[view.synced :])
            except SessionNotFound:
                if attempt:
                    raise SpecDecError(
                        f"{role} service lost session {view.session_id} again right after a full re-send"
                    ) from None
                logger.info("%s lost session %s; re-sending %d tokens", role, view.session_id, len(sequence))
                trace.get_current_span().add_event(
                    "reprefill", {"specdec.service": role, "specdec.tokens": len(sequence)}
                )
                stats.reprefills += 1
                view.synced = 0
            finally:
                elapsed = stats.elapsed_ms() - started
                if role == "draft":
                    stats.draft_ms += elapsed
                else:
                    stats.target_ms += elapsed
        raise AssertionError("unreachable")

    def end_sessions(self, draft_view: SessionView, target_view: SessionView) -> None:
        for client, view in ((self.draft, draft_view), (self.target, target_view)):
            if view.opened:
                self.end_later(client, view.session_id)

    async def wait_cleanup(self) -> None:
        """Until every session end already started has finished (before the services stop)."""
        while self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    def end_later(self, client: DraftClient | TargetClient, session_id: str) -> None:
        """Frees a service's session without delaying (or being cancelled with) the request."""
        task = asyncio.get_running_loop().create_task(client.end_session(session_id))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
