"""One replica of a pool as the coordinator sees it: its channel, its breaker, its last Info,
this coordinator's sessions there and other coordinators' (coordinator.pools keeps the
replicas and refreshes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.breaker import CircuitBreaker
from coordinator.clients import ServiceClient
from specdec.v1 import common_pb2, draft_pb2

PROBE_TIMEOUT_S = 2.0
# A replica whose health check has gone unanswered this many refreshes in a row (each waiting
# PROBE_TIMEOUT_S) is hung: a frozen process, or a machine or network gone without closing its
# connections. Calls in flight there would wait out their deadline (--target-timeout, 60 s) and
# fail the request; they are given up on and go to another replica (module docstring).
HUNG_AFTER_PROBES = 2


@dataclass(eq=False)
class Replica:
    """One replica of a pool, and what the coordinator knows of it."""

    address: str
    client: ServiceClient
    breaker: CircuitBreaker  # consecutive failed calls (the draft's: rounds skip it while open)
    info: common_pb2.ModelInfo | None = None  # its last Info
    serving: bool = False  # serves the pool's model and its health says SERVING
    refused: str = ""  # why it serves no session: another model
    gone: bool = False  # no longer among the pool's DNS records: no new sessions
    sessions: int = 0  # this coordinator's requests placed on it now
    # Of those, the ones whose first call it has not answered: it opens a session at its first
    # call, so its Info may not count them yet (`seen`).
    pending: set[str] = field(default_factory=set)
    ending: int = 0  # this coordinator's sessions done with, their EndSession not answered yet
    reserved_bytes: int = 0  # the KV those sessions may grow to (`room`)
    others_seen: tuple[int, int] = (0, 0)  # other coordinators' sessions at its last two Infos
    moves: int = 0  # sessions moved off it after a failed call
    unanswered: int = 0  # refreshes in a row whose health probe got no answer within PROBE_TIMEOUT_S
    # Since when its Info has come late though its health answers (busy with a long pass), and
    # whether for longer than a call's deadline: a model thread stuck in a pass, hung as well.
    late_since: float | None = None
    stuck: bool = False
    abandoned: int = 0  # calls given up on there while it did not answer

    @property
    def others(self) -> int:
        """Sessions other coordinators held on it at both of the last two counts it gave (its
        Infos and the replies to this coordinator's calls: the replica's count beyond this
        coordinator's, forks left out: a draft steps a request's branches in its own passes, so
        a request's hedges are no load of their own, and this coordinator's would otherwise
        count as others'). Both: a neighbour's request that ended just after one count is not
        counted any longer than the next, which would have a request beside it costed at a load
        that is gone (on a shared host, no drafting)."""
        return min(self.others_seen)

    def passes_ms(self, fallback: tuple[float, ...]) -> tuple[float, ...]:
        """Its calibrated passes (ModelInfo.calibrated_pass_ms), which may differ from the
        pool's first replica's (another machine); `fallback` where it has reported none."""
        return (
            tuple(self.info.calibrated_pass_ms) if self.info is not None and self.info.calibrated_pass_ms else fallback
        )

    def seen(self, info: common_pb2.ModelInfo) -> None:
        """Its Info has answered."""
        self.info = info
        self._count(info.open_sessions - info.fork_sessions)

    def answered(self, session_id: str, held: int = 0) -> None:
        """A call on one of this coordinator's sessions here has been answered: it holds it now.
        `held`: the sessions it held as it answered, forks left out (held_sessions in each Verify
        and Propose reply; 0 from a service that does not say). Counted with its Infos'; with
        Infos alone (every 2 s), a neighbour's request that had ended was still counted for up
        to two refreshes, and a request beside none ran as if loaded: its overlap off."""
        self.pending.discard(session_id)
        if held:
            self._count(held)

    def _count(self, held: int) -> None:
        own = self.sessions - len(self.pending) + self.ending
        self.others_seen = (self.others_seen[1], max(0, held - own))

    @property
    def load(self) -> tuple[int, int]:
        """Sessions on it, this coordinator's now and others' as last counted, then the KV
        bytes its sessions hold (not its prefix cache's: those wait to be reused)."""
        if self.info is None:
            return (self.sessions, 0)
        return (self.sessions + self.others, self.info.kv_cache_bytes - self.info.prefix_cache.bytes)

    @property
    def others_bytes(self) -> int:
        """KV bytes other coordinators' sessions held at its last Info: its sessions' bytes
        (not its prefix cache's, given up first) in the share of them that are others'."""
        info = self.info
        if info is None or not self.others:
            return 0
        held = info.open_sessions - info.fork_sessions
        return (info.kv_cache_bytes - info.prefix_cache.bytes) * min(self.others, held) // held if held > 0 else 0

    def room(self, reserve: int) -> bool:
        """Whether a new session that may grow to `reserve` bytes of KV fits: under its
        --max-sessions, and within its --max-kv-bytes beside what this coordinator's sessions
        there may grow to and what others' hold. With none of this coordinator's sessions
        there, one always fits the budget: a request larger than it runs alone (the replica
        refuses it if it outgrows the budget), never waits for good."""
        info = self.info
        if info is None:
            return True
        if info.max_sessions and self.sessions + self.ending + self.others >= info.max_sessions:
            return False
        if not info.max_kv_cache_bytes or not self.sessions:
            return True
        return self.reserved_bytes + self.others_bytes + reserve <= info.max_kv_cache_bytes

    @property
    def hung(self) -> bool:
        """Has not answered HUNG_AFTER_PROBES probes in a row, or its Info for longer than a call's
        deadline: its sessions leave at their next call."""
        return self.unanswered >= HUNG_AFTER_PROBES or self.stuck

    @property
    def usable(self) -> bool:
        """May take new sessions."""
        return self.serving and not self.gone and self.breaker.allow()


def held_in(reply: draft_pb2.ProposeBranchesResponse) -> int:
    """The held_sessions a ProposeBranches reply carries (each branch's alike; 0: none says)."""
    return max((result.proposal.held_sessions for result in reply.results), default=0)
