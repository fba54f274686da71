"""The coordinator's calls to the draft and target pools: deadlines and retries, each draft
replica's circuit breaker, re-sending the sequence to a service that lost the session, moving
a session to another replica when its own fails, the pair's Info read again when a restarted
draft refuses a call, and ending sessions without delaying the request."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import cast

from opentelemetry import trace

from coordinator.clients import CallRejected, DraftClient, ServiceClient, TargetClient, check_pair, retry_unavailable
from coordinator.config import CoordinatorConfig
from coordinator.metrics import GenerationStats
from coordinator.pair import PairInfo, pair_info
from coordinator.pools import Pool, watch
from coordinator.replica import Replica
from coordinator.state import RetryWindow, Round, SessionView, Source, round_from
from specdec.engine.costs import cost_at
from specdec.errors import DeadlineExceeded, ResourceExhausted, SessionNotFound, SpecDecError, Unavailable
from specdec.rpc import wire
from specdec.sampling.relaxed import RelaxedAcceptance
from specdec.v1 import common_pb2, draft_pb2, target_pb2

logger = logging.getLogger(__name__)


# A draft call that fails UNAVAILABLE is tried once more, 50 ms later, before its round runs
# target-only: a draft only ever speeds a request up, so a round never waits longer on one
# (the breaker, three failures in a row, stops asking a replica that keeps failing).
DRAFT_ATTEMPTS = 2
DRAFT_RETRY_BACKOFF_S = 0.05
REREAD_WAIT_S = 0.5  # how long a request whose draft call was rejected waits for the draft's Info


def verify_fields(
    round_: Round,
    sampling: common_pb2.SamplingParams,
    seed: int,
    step_seeds: Sequence[int] = (),
    stop_token_ids: Collection[int] = (),
    relaxed: RelaxedAcceptance | None = None,
    top_logprobs: int | None = None,
    output_start: int = 0,
    feature_layers: Sequence[int] = (),
) -> dict:
    """A round's VerifyRequest fields but the session's: its drafts, `sampling` and `seed`; a
    target-only call's further steps (`step_seeds`), stopping after a token in
    `stop_token_ids`; `relaxed`: the target also runs the relaxed test on each draft (an
    exact round's call carries nothing of it); `top_logprobs`: the reply carries
    log-probabilities (None: none); `output_start`: the prompt's length, from which penalties
    count generated tokens; `feature_layers`: the reply carries these hidden features (an
    EAGLE-style draft's, PairInfo.feature_layers)."""
    return {
        "draft_token_ids": round_.draft_token_ids,
        "draft_distributions": round_.distributions,
        "draft_parents": round_.parents,
        "sampling": sampling,
        "seed": seed,
        "step_seeds": step_seeds,
        "stop_token_ids": sorted(stop_token_ids),
        "relaxed": wire.relaxed_to_pb(relaxed) if relaxed is not None else None,
        "return_logprobs": top_logprobs is not None,
        "top_logprobs": top_logprobs or 0,
        "output_start": output_start,
        "feature_layers": feature_layers,
    }


class Upstream:
    """The draft and target pools as the round loop sees them: one object shared by every
    request, holding the pools (their replicas, each draft replica's breaker), the watcher that
    refreshes them, and the pair's current Info."""

    def __init__(
        self,
        config: CoordinatorConfig,
        drafts: Pool,
        targets: Pool,
        pair: PairInfo,
        target_info: common_pb2.ModelInfo,
    ) -> None:
        self.config = config
        self.drafts = drafts
        self.targets = targets
        self.pair = pair  # replaced (never changed in place) when a restarted draft's Info differs;
        # a request keeps the one it began with (RequestState.pair) until the draft rejects a call
        self._target_info = target_info  # to rebuild the pair when the draft changes
        self._cleanup: set[asyncio.Task] = set()
        self._refresh: asyncio.Task | None = None
        self.on_refresh: Callable[[], Awaitable[None]] | None = None  # after each pool refresh (health)
        self._watcher = asyncio.get_running_loop().create_task(
            watch((drafts, targets), config.pool_refresh_s, self._refreshed)
        )

    async def _refreshed(self) -> None:
        if self.on_refresh is not None:
            await self.on_refresh()

    def close(self) -> None:
        for task in (self._watcher, self._refresh):
            if task is not None:
                task.cancel()

    async def close_clients(self) -> None:
        await asyncio.gather(self.drafts.close(), self.targets.close())

    @property
    def draft_skipped(self) -> bool:
        """No draft replica takes calls: every breaker open, or none serving."""
        return not self.drafts.serving

    def round_from(
        self, proposal: draft_pb2.ProposeResponse, k: int, address: str, source: Source = Source.DRAFT
    ) -> Round:
        """The drafts of a Propose reply, or a branch's, checked against what was asked: the one
        place a draft's reply becomes a round's drafts."""
        return round_from(proposal, k, address, self.pair.vocab_size, source, self.pair.draft_proposable)

    async def place(
        self,
        draft_view: SessionView,
        target_view: SessionView,
        prompt_ids: list[int],
        max_new_tokens: int,
        wait_s: float,
    ) -> float:
        """A new request's sessions, and the seconds it waited for room: each on the
        least-loaded serving replica of its pool with room for its prompt and max_new_tokens
        (Replica.room), or on the one that took its prompt's prefix before (Pool.place). The
        target's waits for room, up to `wait_s` (Pool.admit), or goes to one that may come
        back when none serves; the draft's never waits (a full draft replica only evicts
        draft caches, re-sent at the next call) and goes nowhere when none serves, so rounds
        run target-only until one does."""
        tokens = len(prompt_ids) + max_new_tokens
        target_view.reserved = self.targets.reservation(tokens)
        target_view.replica, waited_s = await self.targets.admit(
            (target_view.namespace, prompt_ids),
            target_view.reserved,
            wait_s,
            self.config.max_waiting_requests,
            target_view.session_id,
        )
        draft_view.reserved = self.drafts.reservation(tokens)
        draft_view.replica = self.drafts.place(
            prompt=(draft_view.namespace, prompt_ids), reserve=draft_view.reserved, session_id=draft_view.session_id
        )
        return waited_s

    def draft_allowed(self, draft_view: SessionView, unused_forks: list[str]) -> bool:
        """Whether this round may call the draft: the request's draft replica takes calls (its
        breaker is closed) and did not just fail, or the session moves to one that serves, or
        (no other serving) the one that failed is asked again while its breaker allows. A
        session on no replica (none served when it was placed) is placed now."""
        replica = draft_view.replica
        if replica is not None and replica.breaker.allow() and not draft_view.lost:
            return True
        if self.move(self.drafts, draft_view, unused_forks):
            return True
        # No other replica serves: the failed one is asked again while its breaker allows.
        draft_view.lost = False
        return replica is not None and replica.breaker.allow()

    def move(self, pool: Pool, view: SessionView, unused_forks: list[str] | None = None) -> bool:
        """Moves a session off its replica to the least-loaded other one that serves, which is
        re-sent the committed sequence on its next call; False (the session stays) when there
        is none. The old replica's session, and the request's unused forks there, are ended in
        the background (a dead replica's expire by TTL)."""
        old = view.replica
        new = pool.place(avoid=old, reserve=view.reserved, session_id=view.session_id)
        if new is None:
            return False
        if old is not None:
            for session_id in unused_forks or ():
                self.end_later(old.client, session_id, discard=True, epoch=next(view.calls))
            old.moves += 1
            self.end_and_release(pool, old, view, discard=True)
            logger.info("%s session %s moves from %s to %s", pool.role, view.session_id, old.address, new.address)
            trace.get_current_span().add_event(
                "replica.moved", {"specdec.service": pool.role, "specdec.from": old.address, "specdec.to": new.address}
            )
        if unused_forks:
            unused_forks.clear()
        view.replica, view.synced, view.modeled, view.opened, view.lost = new, 0, 0, False, False
        view.moves += old is not None  # a first placement is no move
        return True

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
        features: common_pb2.Features | None = None,
    ) -> draft_pb2.ProposeResponse:
        """A round's draft call, retried on UNAVAILABLE (a restarting draft, a dropped
        connection) but never on a missed deadline: a slow draft is skipped, not waited for.
        `pair`: the request's snapshot of the pair (the draft's vocabulary width).
        `max_copied`: ProposeRequest.max_copied_tokens for a draft that copies (k may then be
        0); None leaves it unset. `tree_widths`: propose a tree instead (k 0). `features`: the
        target's features for an EAGLE-style draft (coordinator.features)."""

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
                features=features,
                **view.draft_fields(),
            )
            if max_copied is not None:  # unset means num_tokens
                request.max_copied_tokens = max_copied
            steps = view.passes_ms(pair.costs.draft_pass_ms if pair.costs is not None else ())
            return cast(DraftClient, view.client).propose(request, prefill_allowance_s(steps, len(new_tokens)))

        return await retry_unavailable(
            lambda: self._with_reprefill("draft", view, sequence, stats, send),
            # A replica whose breaker opened meanwhile (found hung) is not asked again.
            give_up=lambda attempts: attempts >= DRAFT_ATTEMPTS
            or view.replica is None
            or not view.replica.breaker.allow(),
            backoff_s=DRAFT_RETRY_BACKOFF_S,
        )

    def draft_failed(self, exc: SpecDecError, draft_view: SessionView, stats: GenerationStats) -> None:
        """Counts a failed draft call, opens the replica's breaker after enough of them, and
        forgets what the draft held: if it comes back, the next call re-sends the whole
        sequence; an UNAVAILABLE replica's session moves to another draft replica, where the
        pool has one, at the next round. A draft that rejected the call may have restarted with
        other capabilities (no copies, no trees, a lower K): its Info is read again. One that
        cannot hold the request (RESOURCE_EXHAUSTED) counts for this request only, not for the
        breaker."""
        replica = draft_view.replica
        assert replica is not None  # a session on no replica makes no call
        if isinstance(exc, CallRejected) and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_pair(replica))
        stats.draft_failures += 1
        draft_view.synced = draft_view.modeled = 0
        trace.get_current_span().add_event("fallback", {"specdec.reason": str(exc)[:200]})
        if isinstance(exc, ResourceExhausted):
            # The draft cannot hold this request (its KV budget, its session limit) and the
            # target can; the draft node is fine, so the breaker other requests share is untouched.
            logger.info("draft refused the request, which runs target-only rounds before asking again: %s", exc)
            return
        logger.warning("draft call failed, round runs target-only: %s", exc)
        # Gone, or refusing the coordinator (another token): the session moves where one serves.
        draft_view.lost = not isinstance(exc, (DeadlineExceeded, CallRejected))
        if replica.breaker.record_failure():
            logger.warning(
                "draft at %s failed %d times in a row: no round calls it until a pool refresh finds it serving",
                replica.address,
                replica.breaker.failure_threshold,
            )

    async def reread_pair(self, draft_view: SessionView) -> PairInfo:
        """The pair once the Info read that a rejected call started has finished; the pair as
        it was where the draft is unreachable, no longer pairs, or has not answered within
        REREAD_WAIT_S (the read goes on, and a later rejection takes its result): the round
        that waits runs target-only anyway, and a draft must never hold a request up."""
        if self._refresh is not None and not self._refresh.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._refresh), REREAD_WAIT_S)
            except TimeoutError:
                pass
        draft_view.vocab_limit = self.pair.draft_vocab_limit
        return self.pair

    async def _refresh_pair(self, replica: Replica) -> None:
        """Rebuilds the pair from the draft replica's Info as it is now; keeps it where the
        replica is unreachable or no longer pairs with the target (its breaker then keeps
        rounds off it). The chooser's costs stay as measured at start-up (a seed's output does
        not move with a draft restart; a coordinator restart re-measures)."""
        try:
            draft_info = await replica.client.info()
            check_pair(
                draft_info,
                self._target_info,
                self._target_info.tokenizer_fingerprint,
                replica.address,
                self.targets.spec.text,
                self.config.min_vocab_overlap,
            )
        except SpecDecError as exc:
            logger.warning("draft at %s refused a call and its Info does not pair: %s", replica.address, exc)
            return
        refreshed = pair_info(self.config, draft_info, self._target_info, self.pair.costs)
        if refreshed != self.pair:
            logger.warning(
                "draft at %s changed (copies %s -> %s, trees %s -> %s, max K %d -> %d, copies up to %d -> %d): "
                "rounds follow its new Info",
                replica.address,
                self.pair.draft_copies,
                refreshed.draft_copies,
                self.pair.trees,
                refreshed.trees,
                self.pair.max_num_speculative_tokens,
                refreshed.max_num_speculative_tokens,
                self.pair.max_copied_tokens,
                refreshed.max_copied_tokens,
            )
            self.pair = refreshed

    async def verify(
        self,
        view: SessionView,
        sequence: list[int],
        fields: dict,
        stats: GenerationStats,
        retry: RetryWindow,
    ) -> target_pb2.VerifyResponse:
        """The round's verify: a VerifyRequest of `fields` (`verify_fields`) for the session's
        tokens. A target replica that is UNAVAILABLE (gone, restarting) is left for another
        that serves, where the pool has one, which is re-sent the committed sequence; otherwise
        it is retried for as long as `retry` allows: back up, it has lost the session,
        answers NOT_FOUND and is re-sent the sequence. Either way the call, and the output, are
        the same."""

        def send(keep: int, new_tokens: list[int]):
            request = target_pb2.VerifyRequest(
                session_id=view.session_id,
                keep_tokens=keep,
                new_tokens=new_tokens,
                cache_namespace=view.namespace,
                **fields,
            )
            passes = view.passes_ms(tuple(self._target_info.calibrated_pass_ms))
            return cast(TargetClient, view.client).verify(request, prefill_allowance_s(passes, len(new_tokens)))

        loop = asyncio.get_running_loop()
        if view.replica is not None and view.replica.hung:
            self.move(self.targets, view)  # before the call would wait for it (Pool._leave_hung)

        def failed() -> bool:
            stats.target_retries += 1
            replica = view.replica
            assert replica is not None
            replica.serving = False  # no new sessions until a refresh finds it serving
            return self.move(self.targets, view)

        try:
            return await retry_unavailable(
                lambda: self._with_reprefill("target", view, sequence, stats, send),
                give_up=retry.give_up(loop.time),
                backoff_s=0.1,
                on_failure=failed,
            )
        except Unavailable as exc:
            if isinstance(exc, DeadlineExceeded) or len(self.targets.replicas) == 1:
                raise
            raise Unavailable(f"no replica of {self.targets.describe()} answered: {exc}") from exc

    async def _with_reprefill(self, role: str, view: SessionView, sequence: list[int], stats: GenerationStats, send):
        """Sends only the unseen tail; if the service lost the session, re-sends everything once."""
        for attempt in range(2):
            view.opened = True  # even a failed call may have opened it; ending is idempotent
            started = stats.elapsed_ms()
            replica = view.replica
            try:
                reply = await send(view.synced, sequence[view.synced :])
                if replica is not None:
                    replica.answered(view.session_id, reply.held_sessions)  # it holds the session now
                return reply
            except SessionNotFound:
                if attempt:
                    raise SpecDecError(
                        f"{role} service lost session {view.session_id} again right after a full re-send"
                    ) from None
                logger.info("%s lost session %s; re-sending %d tokens", role, view.session_id, len(sequence))
                trace.get_current_span().add_event(
                    "reprefill", {"specdec.service": role, "specdec.tokens": len(sequence)}
                )
                if role == "target" and replica is not None:
                    await self.targets.check_same_model(replica)
                stats.reprefills += 1
                view.synced = view.modeled = 0
            finally:
                elapsed = stats.elapsed_ms() - started
                if role == "draft":
                    stats.draft_ms += elapsed
                else:
                    stats.target_ms += elapsed
        raise AssertionError("unreachable")

    def end_sessions(self, draft_view: SessionView, target_view: SessionView) -> None:
        """Ends a finished request's sessions (in the background) and frees their places."""
        for pool, view in ((self.drafts, draft_view), (self.targets, target_view)):
            if view.replica is not None:
                self.end_and_release(pool, view.replica, view)

    def end_and_release(self, pool: Pool, replica: Replica, view: SessionView, discard: bool = False) -> None:
        """Ends `view`'s session on `replica` in the background and frees its place there once
        the replica has answered: until then the session still holds one of its --max-sessions,
        and a request placed in it meanwhile would be refused (RESOURCE_EXHAUSTED)."""
        reserved = view.reserved
        if not view.opened:
            pool.release(replica, reserved, session_id=view.session_id)
            return
        pool.release(replica, reserved, ending=True, session_id=view.session_id)
        epoch = next(view.calls)
        ended = functools.partial(pool.ended, replica, reserved)
        self.end_later(replica.client, view.session_id, discard, ended, epoch, None if discard else view.synced)

    async def wait_cleanup(self) -> None:
        """Until every session end already started has finished (before the services stop)."""
        while self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    def end_later(
        self,
        client: ServiceClient,
        session_id: str,
        discard: bool = False,
        then: Callable[[], None] | None = None,
        epoch: int = 0,
        committed: int | None = None,
    ) -> None:
        """Frees a service's session without delaying (or being cancelled with) the request;
        `discard`: its sequence is not the request's output, so the service keeps nothing of it;
        `then()` once the service has answered (or the call has failed); `epoch`: a number
        after every call sent for the session, none of which may open it afterwards (a
        cancelled call still on its way: EndSessionRequest.epoch); `committed`: the leading tokens
        of its sequence that are the request's output, where that is known."""
        task = asyncio.get_running_loop().create_task(client.end_session(session_id, discard, epoch, committed))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        if then is not None:
            task.add_done_callback(lambda _: then())


def prefill_allowance_s(passes: Sequence[float], new_tokens: int) -> float:
    """A call's time past its flat deadline (--draft-timeout, --target-timeout): a calibrated
    one-token pass (`passes`: by new tokens) per token it sends. A long prompt's prefill is no
    hang, and one given up stops, so under a flat deadline it would start over every round."""
    return new_tokens * (cost_at(tuple(passes), 1) if passes else 0.0) / 1e3
