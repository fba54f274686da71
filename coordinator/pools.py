"""Replica pools: every replica serving the draft, or the target, as the coordinator sees it.

A pool is the addresses --draft or --target name, or a DNS name's records, read again at
every refresh (specdec.rpc.dns). Every --pool-refresh seconds each replica is asked its health
(a draining replica, after SIGTERM, answers NOT_SERVING) and its Info: its load, and that it
serves the pool's model. A replica joins when both answer and leaves when either fails; one
serving another model (another checkpoint, tokenizer or numerics) is refused and named.

A request's session is placed by the pool's placement (coordinator.placement: the least
loaded serving replica, or the one holding its prompt's prefix) and stays there, since the
replica holds the session's KV cache: a gRPC channel over several replicas would balance
calls, not sessions, and a call landing on a replica that never saw the session costs a
re-prefill. A session moves only when a call to its replica fails (`Upstream.move`): it is
re-sent its committed sequence on another replica, which is what a restarted replica gets
too, so the output does not change. A replica that stops answering without closing its
connections fails no call by itself, so the refresh that finds it hung gives up on its calls
in flight (`Pool._leave_hung`), and they fail over the same way.

A new target session is placed only where it fits (`Replica.room`): within the replica's
--max-sessions, and within its KV budget (--max-kv-bytes) with every session this coordinator
placed there grown to its prompt and max_new_tokens, beside what other coordinators' sessions
hold. When no serving replica has room, requests wait in arrival order (`Pool.admit`) for a
session to end, as TGI and vLLM queue rather than over-admit: a replica holding more sessions
than its budget evicts the least recently used, whose next call re-prefills and evicts
another, so an over-full replica spends its passes re-reading prompts.

No gRPC here beyond the clients' calls; pure bookkeeping and a watcher loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from coordinator.breaker import CircuitBreaker
from coordinator.clients import ServiceClient
from coordinator.identity import mismatch, served
from coordinator.placement import Placement, PrefixAffinity, Prompt, prefix_keys
from coordinator.replica import PROBE_TIMEOUT_S, Replica
from specdec.errors import DeadlineExceeded, ResourceExhausted, ServiceRefused, SpecDecError, Unavailable
from specdec.rpc.dns import PoolSpec, resolve
from specdec.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Pool:
    """One role's replicas, placement and the refresh that keeps them current."""

    role: str  # "draft" / "target"
    spec: PoolSpec
    make_client: Callable[[str], ServiceClient]
    breaker_failures: int = 3
    stuck_after_s: float = 60.0  # Info late this long, though its health answers: hung (a call's deadline)
    replicas: dict[str, Replica] = field(default_factory=dict)  # by address, in the order found
    reference: common_pb2.ModelInfo | None = None  # the first replica's Info: what every replica must match
    resolve_error: str = ""  # the last DNS failure, until a lookup succeeds
    resolve_failures: int = 0
    _turn: int = 0
    _closing: set[asyncio.Task] = field(default_factory=set)  # closes of replicas gone from the records
    # By address: a replica's EndSessions that found it not answering, sent again since it answers.
    _ending: dict[str, asyncio.Task] = field(default_factory=dict)
    placement: Placement = field(default_factory=PrefixAffinity)  # which replica a new session goes to
    # Requests waiting for room (`admit`), oldest first; each is woken to look again when a
    # session ends or a refresh may have made room.
    _waiting: deque[asyncio.Event] = field(default_factory=deque)

    def describe(self) -> str:
        if not self.spec.dynamic:
            return f"the {self.role} pool {self.spec.text}"
        return f"the {self.role} pool {self.spec.text} ({', '.join(self.replicas) or 'none resolved'})"

    @property
    def serving(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.usable]

    def add(self, address: str, client: ServiceClient | None = None) -> Replica:
        replica = Replica(address, client or self.make_client(address), CircuitBreaker(self.breaker_failures))
        self.replicas[address] = replica
        return replica

    async def start(self, timeout_s: float) -> Replica:
        """Refreshes until at least one replica serves (the first in the pool's order sets what
        every replica must match), or UNAVAILABLE naming the pool after `timeout_s`. Replicas
        not up yet join at a later refresh."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.refresh()
            if first := next((replica for replica in self.replicas.values() if replica.serving), None):
                break
            if refusals := [replica.refused for replica in self.replicas.values() if replica.refused]:
                raise ServiceRefused(refusals[0])  # a token or a model the operator must change
            if loop.time() >= deadline:
                reasons = "; ".join(f"{r.address}: {r.refused or 'no answer'}" for r in self.replicas.values())
                raise Unavailable(
                    f"no replica of {self.describe()} served within {timeout_s:.0f} s"
                    + (f" ({reasons})" if reasons else f" ({self.resolve_error})")
                )
            await asyncio.sleep(0.5)
        for replica in self.replicas.values():
            if not replica.serving:
                logger.warning(
                    "%s replica %s is not serving (%s); it joins when it is",
                    self.role,
                    replica.address,
                    replica.refused or "no answer",
                )
        return first

    async def refresh(self) -> None:
        """Resolves the pool's addresses (a DNS name's records) and asks every replica its
        health and Info. A lookup that fails keeps the replicas known."""
        try:
            addresses = await resolve(self.spec)
        except OSError as exc:
            self.resolve_failures += 1
            if str(exc) != self.resolve_error:
                logger.warning("%s: DNS lookup failed, retried every refresh: %s", self.describe(), exc)
            self.resolve_error = str(exc) or type(exc).__name__
        else:
            if self.resolve_error:
                logger.info("%s resolves again", self.describe())
            self.resolve_error = ""
            self._update(addresses)
        live = [replica for replica in self.replicas.values() if not replica.gone]
        answers = await asyncio.gather(*(self._ask(replica) for replica in live))
        for replica, info in zip(live, answers):  # in the pool's order: the first sets the reference
            self._apply(replica, info)
        self._wake()  # others' sessions may have ended, or a replica joined

    def _end_unended(self, replica: Replica) -> None:
        """A replica heard afresh is sent again, in the background, the EndSessions that found
        it not answering (ServiceClient.end_unended), one sending at a time."""
        if replica.client.unended and replica.address not in self._ending:
            ending = asyncio.get_running_loop().create_task(replica.client.end_unended())
            self._ending[replica.address] = ending
            ending.add_done_callback(functools.partial(self._ended_unended, replica.address))

    def _ended_unended(self, address: str, task: asyncio.Task) -> None:
        self._ending.pop(address, None)

    def _update(self, addresses: Iterable[str]) -> None:
        """Adds new addresses in the pool's order (its first replica to answer sets the model
        every other must serve), and marks those gone from it."""
        ordered = list(dict.fromkeys(addresses))
        current = set(ordered)
        for address in ordered:
            replica = self.replicas.get(address)
            if replica is None:
                logger.info("%s: found replica %s", self.describe(), address)
                self.add(address)
            elif replica.gone:
                replica.gone = False
        for replica in list(self.replicas.values()):
            if replica.address not in current and not replica.gone:
                logger.info("%s: replica %s left the DNS records; it takes no new sessions", self.role, replica.address)
                replica.gone = True
                replica.serving = False
                self._drop_if_idle(replica)

    async def _ask(self, replica: Replica) -> common_pb2.ModelInfo | None:
        """The replica's Info when its health says SERVING; None when it does not answer so.
        Whether it answers at all is its health's to say, which its event loop answers at once:
        Info waits for its model thread, behind the pass running there (a long prompt's prefill
        runs for seconds on a CPU), so a replica whose Info is late is busy, not hung, and keeps
        its last Info (which closes no breaker), for as long as a call's deadline (`stuck_after_s`,
        or, if later, that of the last of this coordinator's calls sent there before its Info went
        late, which grows with a prompt's prefill): past it, its model thread is stuck in a pass (a
        GPU hang, a deadlocked collective): hung. One refusing the coordinator (its token) is refused."""
        serving = await replica.client.serving(PROBE_TIMEOUT_S)
        replica.unanswered = replica.unanswered + 1 if serving is None else 0
        if not serving:  # silent, draining or gone (its calls fail by themselves): late from scratch when back
            replica.late_since = None
            return None
        try:
            info = await replica.client.info(PROBE_TIMEOUT_S)
        except ServiceRefused as exc:
            replica.refused = str(exc)
            return None
        except DeadlineExceeded:  # busy with a pass, or stuck in one
            now = asyncio.get_running_loop().time()
            replica.late_since = now if replica.late_since is None else replica.late_since
            # A call sent before its Info went late may be what it is busy with (a long prompt's
            # call has its prefill's time too); one sent since waits behind, and would keep a
            # hung replica from ever being found so.
            due = replica.client.calls_due(sent_by=replica.late_since)
            replica.stuck = now - replica.late_since > self.stuck_after_s and (due is None or now > due)
            return None if replica.stuck else replica.info
        except SpecDecError:
            return None
        replica.late_since, replica.stuck = None, False
        return info

    async def check_same_model(self, replica: Replica) -> None:
        """Before a session lost by `replica` is re-sent there whole: it may have restarted
        serving another model, and a request continued there would mix two models' tokens.
        Unavailable if so (the replica is refused: the session moves, or the request fails)."""
        if self.reference is None:
            return
        try:
            info = await replica.client.info(PROBE_TIMEOUT_S)
        except SpecDecError:  # no answer in time (Info waits behind a pass): the refresh will ask again
            return
        if refused := self.mismatch(info):
            self._log_change(replica, info, refused)
            replica.refused, replica.serving = refused, False
            replica.seen(info)  # what a refresh keeps while its Info is late (`_ask`)
            raise Unavailable(f"{self.role} replica {replica.address} lost the session, and is refused now: {refused}")

    def _apply(self, replica: Replica, info: common_pb2.ModelInfo | None) -> None:
        fresh = info is not replica.info  # not its last one again (busy: `_ask`)
        if info is None:
            if replica.serving:
                logger.warning("%s replica %s stopped serving: no new sessions go there", self.role, replica.address)
            replica.serving = False
            if replica.hung:
                self._leave_hung(replica)
            return
        if self.reference is None:
            self.reference = info
        refused = self.mismatch(info) or ("" if fresh else replica.refused)  # a late Info may predate a restart
        self._log_change(replica, info, refused)
        replica.refused = refused
        if fresh:
            replica.seen(info)
            self._end_unended(replica)
        if refused:
            replica.serving = False
            return
        if not replica.serving and self.reference is not info:
            logger.info("%s replica %s joins %s", self.role, replica.address, self.describe())
        replica.serving = True
        if replica.breaker.is_open and fresh:
            logger.info("%s replica %s is serving again: rounds call it again", self.role, replica.address)
            replica.breaker.close()

    def _leave_hung(self, replica: Replica) -> None:
        """Gives up on the calls in flight to a hung replica: they fail UNAVAILABLE, and their
        sessions move to another replica (re-sent their sequences: the output is unchanged) or,
        a draft's, run target-only rounds, since its breaker opens until it answers again. A
        target pool with no other replica serving leaves them waiting: there is nowhere to go,
        and the replica may yet answer (a long pause) before their deadline."""
        if self.role == "target" and not any(other.usable for other in self.replicas.values() if other is not replica):
            return
        replica.breaker.trip()
        silent = f"health probes for {replica.unanswered * PROBE_TIMEOUT_S:.0f} s"
        calls = replica.client.abandon_calls(
            f"has not answered {silent if not replica.stuck else f'Info for {self.stuck_after_s:.0f} s'}"
        )
        if calls:
            replica.abandoned += calls
            logger.warning(
                "%s replica %s does not answer (%d probes in a row): %d calls in flight there are given up on "
                "and their sessions move",
                self.role,
                replica.address,
                replica.unanswered,
                calls,
            )

    def _log_change(self, replica: Replica, info: common_pb2.ModelInfo, refused: str) -> None:
        """Logs a replica newly refused, or newly serving what the pool's first did not: a draft
        of another model (only the speed changes), a target's same weights from another path."""
        assert self.reference is not None
        if refused:
            if refused != replica.refused:
                logger.error("%s replica %s refused: %s", self.role, replica.address, refused)
            return
        if served(info) in (served(self.reference), replica.info and served(replica.info)):
            return
        draft = self.role == "draft"
        logger.log(
            logging.WARNING if draft else logging.INFO,
            "%s replica %s serves %s where the pool's first served %s: %s",
            self.role,
            replica.address,
            served(info),
            served(self.reference),
            "outputs stay exact, speeds may differ" if draft else "the same weights from another path",
        )

    def mismatch(self, info: common_pb2.ModelInfo) -> str:
        """What makes `info` another model than the pool's, in words (coordinator.identity)."""
        assert self.reference is not None
        return mismatch(self.role, self.reference, info)

    def reservation(self, tokens: int) -> int:
        """KV bytes a session of `tokens` tokens may hold on this pool's replicas: those
        tokens and a verify's or proposal's rows beyond them, within the context."""
        info = self.reference
        if info is None:
            return 0
        return min(tokens + info.max_speculative_tokens + 1, info.max_context) * info.kv_bytes_per_token

    def place(
        self,
        avoid: Replica | None = None,
        prompt: Prompt | None = None,
        reserve: int = 0,
        fit: bool = False,
        session_id: str = "",
    ) -> Replica | None:
        """A new session's replica, as the pool's placement chooses among those serving with
        room for it (`Replica.room` for `reserve` bytes of KV; any serving where none has
        room, unless `fit`), ties in turn; None when none is but `avoid`. `prompt`: its cache
        namespace and token ids, for a placement that follows cached prefixes. `session_id`:
        the session's, pending there until its first call is answered (`Replica.answered`)."""
        serving = [replica for replica in self.serving if replica is not avoid]
        candidates = [replica for replica in serving if replica.room(reserve)] or ([] if fit else serving)
        if not candidates:
            return None
        keys = prefix_keys(prompt, self.block_tokens)  # hashed once, for both of the placement's calls
        chosen = self._take(self.placement.choose(candidates, keys), reserve, session_id)
        self.placement.placed(keys, chosen)
        return chosen

    @property
    def block_tokens(self) -> int:
        """The replicas' prefix-cache block (prefix_block_tokens, from Info); 0 where they keep none."""
        cache = self.reference.prefix_cache if self.reference is not None else None
        return cache.block_tokens if cache is not None and cache.max_bytes else 0

    def place_anywhere(self, reserve: int = 0, session_id: str = "") -> Replica | None:
        """A target session's replica when none serves: one with room that may come back (a
        restarting target, or one that missed a probe, is retried until the request's retry
        time); None where none has room (wait, as for a full pool); UNAVAILABLE naming the
        pool where none may come back."""
        waiting = [replica for replica in self.replicas.values() if not (replica.refused or replica.gone)]
        if not waiting:
            raise Unavailable(f"no replica of {self.describe()} can serve: {self.resolve_error or 'all refused'}")
        roomy = [replica for replica in waiting if replica.room(reserve)]
        return self._take(roomy, reserve, session_id) if roomy else None

    async def admit(
        self, prompt: Prompt, reserve: int, wait_s: float, max_waiting: int, session_id: str = ""
    ) -> tuple[Replica, float]:
        """A new target session's replica, and the seconds it waited for room: at once where
        one serving has room for `reserve` bytes and no request waits before it; otherwise
        in arrival order, as sessions end. RESOURCE_EXHAUSTED when `max_waiting` requests
        already wait, or after `wait_s`. With no replica serving, one with room that may come
        back (`place_anywhere`: a restarting target is waited for by the request's retries)."""
        if not self._waiting and (placed := self._admit_now(prompt, reserve, session_id)):
            return placed, 0.0
        if len(self._waiting) >= max_waiting:
            raise ResourceExhausted(
                f"every replica of {self.describe()} is full and {len(self._waiting)} requests already wait "
                "(the most that may); retry later"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        turn = asyncio.Event()
        self._waiting.append(turn)
        try:
            while True:
                if self._waiting[0] is turn and (placed := self._admit_now(prompt, reserve, session_id)):
                    return placed, loop.time() - started
                turn.clear()
                left = started + wait_s - loop.time()
                try:
                    await asyncio.wait_for(turn.wait(), max(left, 0.0))
                except TimeoutError:
                    raise ResourceExhausted(
                        f"waited {wait_s:.0f} s (--queue-timeout) for room on {self.describe()}: every replica "
                        "holds what its KV budget (--max-kv-bytes) or --max-sessions allows; retry later"
                    ) from None
        finally:
            self._waiting.remove(turn)
            self._wake()  # the next in line may fit now

    def _admit_now(self, prompt: Prompt, reserve: int, session_id: str) -> Replica | None:
        """A serving replica with room, or with none serving `place_anywhere`; None: wait. A
        replica that stops counting as serving (one failed call, one missed probe) is no
        reason to place the queue on it past its room."""
        placed = self.place(prompt=prompt, reserve=reserve, fit=True, session_id=session_id)
        return placed or (None if self.serving else self.place_anywhere(reserve, session_id))

    @property
    def waiting(self) -> int:
        """Requests waiting for room (`admit`)."""
        return len(self._waiting)

    def _wake(self) -> None:
        if self._waiting:
            self._waiting[0].set()

    def _take(self, choices: list[Replica], reserve: int = 0, session_id: str = "") -> Replica:
        """One of `choices`, in turn, counted as holding one more session that may grow to
        `reserve` bytes of KV."""
        self._turn += 1
        chosen = choices[self._turn % len(choices)]
        chosen.sessions += 1
        chosen.reserved_bytes += reserve
        if session_id:
            chosen.pending.add(session_id)
            chosen.client.forget_unended(session_id)
        return chosen

    def release(self, replica: Replica, reserve: int = 0, ending: bool = False, session_id: str = "") -> None:
        """A request's session, placed with `reserve` bytes, left `replica` (ended or moved).
        `ending`: its EndSession is not answered yet, so it keeps its place there (`room`),
        though no longer the replica's load, until `ended`."""
        replica.sessions -= 1
        replica.pending.discard(session_id)
        if ending:
            replica.ending += 1
        else:
            self._freed(replica, reserve)

    def ended(self, replica: Replica, reserve: int = 0) -> None:
        """The EndSession of a session `release`d as ending has been answered (or has failed)."""
        replica.ending -= 1
        self._freed(replica, reserve)

    def _freed(self, replica: Replica, reserve: int) -> None:
        replica.reserved_bytes -= reserve
        self._wake()
        self._drop_if_idle(replica)

    def _drop_if_idle(self, replica: Replica) -> None:
        """A replica gone from the DNS records leaves the pool, its channel closed, once none of
        this coordinator's sessions is left there (a rollout's old pods, or none at all)."""
        if replica.gone and replica.sessions <= 0 and replica.ending <= 0:
            self.replicas.pop(replica.address, None)
            task = asyncio.get_running_loop().create_task(replica.client.close())
            self._closing.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for ending in list(self._ending.values()):  # their sessions expire by TTL, as before
            ending.cancel()
        await asyncio.gather(*self._ending.values(), return_exceptions=True)
        await asyncio.gather(*(replica.client.close() for replica in self.replicas.values()))


async def watch(pools: Iterable[Pool], interval_s: float, on_refresh: Callable[[], Awaitable[None]]) -> None:
    """Refreshes every pool each `interval_s` until cancelled; `on_refresh` after each."""
    pools = list(pools)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.gather(*(pool.refresh() for pool in pools))
            await on_refresh()
        except Exception:  # noqa: BLE001 - a watcher that dies silently would freeze the pools
            logger.exception("refreshing the replica pools failed; trying again in %.1f s", interval_s)
