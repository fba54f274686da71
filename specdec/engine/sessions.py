"""Per-session token sequences with a KV cache that is cropped, never rebuilt, on rollback.

Both model services keep one `KVSession` per generation. A call says how much of the
session's sequence is still valid (`keep_tokens`) and which tokens follow; the session crops
its cache to that prefix and hands back only the tokens the model has not seen yet.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from transformers import DynamicCache
from transformers.cache_utils import Cache

from specdec.engine.kv import cache_prefix
from specdec.engine.kv_pool import PoolCache, PoolFull, compact
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.tree_pass import CachedTree, keep_tree_path
from specdec.errors import InvalidArgument, ResourceExhausted, SessionNotFound, StaleRequest

if TYPE_CHECKING:
    from specdec.engine.features import FeatureTrack

T = TypeVar("T")


@dataclass
class KVSession:
    session_id: str
    tokens: list[int] = field(default_factory=list)  # full sequence; may run ahead of the cache
    cache: Cache | None = field(default_factory=DynamicCache)  # a PoolCache or DynamicCache; None: a model-free drafter
    last_used: float = field(default_factory=time.monotonic)
    epoch: int = 0  # newest call number served (ProposeRequest.epoch)
    tree: CachedTree | None = None  # tree nodes cached behind `tokens`, until the next call
    namespace: str = ""  # the prefix cache's namespace for this session's blocks (cache_namespace)
    # Leading cache entries known to be exactly what a fresh prefill computes: taken from the
    # prefix cache, run in block-aligned prefill passes, or run in any solo pass of a per-token
    # exact runner (ModelRunner.per_token_exact). The only ones a prefix cache may keep.
    aligned_tokens: int = 0
    # A draft session's tokens its caller sent (keep_tokens + new_tokens of its last call); the
    # rest are its own proposals. None: all of them.
    committed_tokens: int | None = None
    # A bridged draft's (draft_service.vocab_bridge): caller_positions[i] is how many of
    # `tokens` its caller's first i tokens became (the caller's tokens sent so far; [0] first).
    # None: the caller and the session count the same tokens.
    caller_positions: list[int] | None = None
    # Opened as a fork (SessionStore.fork) and neither continued by a call nor forked from
    # since: a branch its caller has not taken (ModelInfo.fork_sessions).
    forked: bool = False
    # An EAGLE head's session: the target's features and the head's predictions by position
    # (specdec.engine.features.FeatureTrack); None for every other model.
    features: FeatureTrack | None = None

    def model_cache(self) -> Cache:  # a model-free drafter's sessions have none
        if self.cache is None:
            raise AssertionError(f"session {self.session_id} belongs to a model-free drafter and has no KV cache")
        return self.cache

    @property
    def cached_tokens(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @property
    def kv_bytes(self) -> int:
        """Bytes of the cache's entries (not a pool extent's spare room): what --max-kv-bytes counts."""
        if self.cache is None:
            return 0
        if isinstance(self.cache, PoolCache):
            return self.cache.used_bytes
        return sum(
            tensor.nbytes
            for layer in getattr(self.cache, "layers", ())
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if tensor is not None
        )

    def rollback(self, keep_tokens: int, new_tokens: list[int]) -> None:
        """Keeps the first `keep_tokens` of the sequence and appends `new_tokens` (no model work)."""
        if keep_tokens < 0 or keep_tokens > len(self.tokens):
            raise InvalidArgument(
                f"keep_tokens={keep_tokens} is outside the session's sequence of {len(self.tokens)} tokens; "
                f"it must be in [0, {len(self.tokens)}]"
            )
        del self.tokens[keep_tokens:]
        self.tokens.extend(new_tokens)
        self.last_used = time.monotonic()

    def extend(self, keep_tokens: int, new_tokens: list[int], scored: int = 1) -> list[int]:
        """Rolls back to `keep_tokens`, appends `new_tokens`; returns the tokens to run, the last `scored` always."""
        if self.tree is not None:
            tree, self.tree = self.tree, None
            keep_tokens, new_tokens = self._reuse_tree(tree, keep_tokens, new_tokens, len(new_tokens) - scored)
        self.rollback(keep_tokens, new_tokens)
        surplus = self.cached_tokens - keep_tokens
        if surplus > 0:
            # transformers 5 semantics: a negative argument removes that many tokens.
            self.model_cache().crop(-surplus)
        if not self.tokens:
            raise InvalidArgument("the session's sequence is empty; send the prompt as new_tokens")
        if self.cached_tokens == len(self.tokens):
            # Every token is cached (a pre-draft continues from a kept prefix that ends on a
            # cached token): re-run the last one, since its logits are what the caller needs.
            self.model_cache().crop(-1)
        self.aligned_tokens = min(self.aligned_tokens, self.cached_tokens)
        return self.tokens[self.cached_tokens :]

    @property
    def cacheable_tokens(self) -> int:
        """Leading tokens a prefix cache may keep: aligned, still cached, still the sequence's."""
        return min(self.aligned_tokens, self.cached_tokens, len(self.tokens))

    def _reuse_tree(self, tree: CachedTree, keep_tokens: int, new_tokens: list[int], upto: int) -> tuple[int, list]:
        """Keeps the cached tree nodes on the path the first `upto` of `new_tokens` spell (a
        gather: the path's entries need not be contiguous) and drops the others; returns the
        call's keep and new tokens with that path counted as kept."""
        cache = self.model_cache()
        if self.cached_tokens != tree.start + tree.cached_nodes:
            raise AssertionError(f"session {self.session_id}: the cache does not end in the tree it recorded")
        if keep_tokens != tree.start or keep_tokens != len(self.tokens):
            cache.crop(-tree.cached_nodes)  # a rollback past the tree: none of its nodes is kept
            return keep_tokens, new_tokens
        path = tree.path(new_tokens[: max(0, upto)])
        keep_tree_path(cache, tree.start, path)
        self.tokens.extend(new_tokens[: len(path)])
        return keep_tokens + len(path), new_tokens[len(path) :]

    def advance_epoch(self, epoch: int) -> None:
        """Refuses a call older than one already served (0 = the caller does not number calls):
        a cancelled pre-draft that reaches the service late must not rewind the session."""
        if epoch and epoch <= self.epoch:
            raise StaleRequest(
                f"call epoch {epoch} is not newer than epoch {self.epoch} already served for session "
                f"{self.session_id!r}; it was superseded"
            )
        self.epoch = max(self.epoch, epoch)


RETIRED_KEPT = 4096  # ended session ids remembered (SessionStore.retire): about 200 KB


class SessionStore:
    """Sessions by id with an idle TTL, a cap on how many are held, and a KV byte budget
    enforced by evicting the least recently used sessions.

    An evicted session is not an error for its generation: its next call gets NOT_FOUND and
    the coordinator re-sends the committed sequence (re-prefill), so eviction trades compute
    for memory and never changes an output.

    Not thread-safe: a service touches it only from its single model thread (the metrics
    thread only reads sizes).
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        cache_factory: Callable[[], Cache | None] = DynamicCache,
        max_kv_bytes: int = 0,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_kv_bytes = max_kv_bytes  # 0: no budget
        self.evicted = 0  # sessions dropped to make room (not counting TTL expiry)
        self._cache_factory = cache_factory
        self._sessions: OrderedDict[str, KVSession] = OrderedDict()
        # Never evicted, as their pass would keep their pages and they would be lost for nothing: sessions
        # a running decode batch holds (specdec.engine.batched_pass.DecodeBatch) → the bytes each was admitted
        # to grow by there (counted for others' calls), and those of the calls set up or run together (`sharing`).
        self._held: dict[str, int] = {}
        self._sharing: frozenset[str] = frozenset()
        # Finished and idle sessions' prompt blocks; its bytes count in the KV budget and are
        # given up before any live session is evicted.
        self.prefix = prefix
        # Ended session ids → the newest call number their caller had sent when it ended them
        # (`retire`), the most recent RETIRED_KEPT: a call so numbered that arrives later opens
        # nothing (a cancelled branch call still queued behind the EndSession would otherwise
        # fork a session nobody ends, held till its TTL).
        self._retired: OrderedDict[str, int] = OrderedDict()

    def make_room(self, session: KVSession, extra_bytes: int, bytes_per_token: int, pending_bytes: int = 0) -> None:
        """Before `session` grows its cache by `extra_bytes`: evicts least recently used other
        sessions until everything fits the budget; RESOURCE_EXHAUSTED if `session` alone
        cannot fit, saying by how much. `pending_bytes`: what other sessions sharing the same
        batched pass will add; they count toward the total, not toward `session`, and are not
        evicted (`sharing`). A pool session then reserves the room, so no pass fails halfway."""
        if self.max_kv_bytes:
            self._fit_budget(session, extra_bytes, bytes_per_token, pending_bytes)
        if isinstance(pooled := session.cache, PoolCache):
            tokens = session.cached_tokens + extra_bytes // max(bytes_per_token, 1)
            self._with_room(lambda: pooled.reserve(tokens), session)

    def _fit_budget(self, session: KVSession, extra_bytes: int, bytes_per_token: int, pending_bytes: int) -> None:
        needed = session.kv_bytes + extra_bytes
        if needed > self.max_kv_bytes:
            tokens = needed // bytes_per_token if bytes_per_token else 0
            raise ResourceExhausted(
                f"session {session.session_id!r} would hold {needed} bytes of KV cache ({tokens} tokens at "
                f"{bytes_per_token} bytes each); the service's KV budget (--max-kv-bytes) is {self.max_kv_bytes} "
                f"bytes, about {self.max_kv_bytes // max(bytes_per_token, 1)} tokens"
            )
        batched = sum(grow for held_id, grow in self._held.items() if held_id != session.session_id)
        total = self.kv_bytes() + extra_bytes + pending_bytes + batched  # batched: what a decode batch may add
        if total > self.max_kv_bytes and self.prefix is not None:
            total -= self.prefix.evict(total - self.max_kv_bytes)
        spared = self._spared(session)
        for session_id in [sid for sid in self._sessions if sid not in spared]:  # least recently used first
            if total <= self.max_kv_bytes:
                break
            total -= self._evict(session_id)

    def _spared(self, session: KVSession | None) -> set[str]:
        """Never evicted for `session`: itself, a decode batch's (`hold`), those `sharing` its batch."""
        return {*self._held, *self._sharing, *((session.session_id,) if session is not None else ())}

    @contextlib.contextmanager
    def sharing(self, session_ids: Iterable[str]) -> Iterator[None]:
        """While a batch's calls are set up and run, none of these sessions is evicted for another."""
        before = self._sharing
        self._sharing = before | {session_id for session_id in session_ids if session_id}
        try:
            yield
        finally:
            self._sharing = before

    def _evict(self, session_id: str) -> int:  # → the bytes its entries held
        evicted, self.evicted = self._sessions.pop(session_id), self.evicted + 1
        if isinstance(evicted.cache, PoolCache):  # no pass runs it (`_spared`): its pages go back now, though what
            evicted.cache.release()  # a call that ended left (a decode batch's row, its drafting) still refers to it
        return evicted.kv_bytes

    def _with_room(self, take: Callable[[], T], session: KVSession | None = None) -> T:
        """take(), which takes pages of the KV pool: where no run is long enough, the sessions
        not `_spared` are compacted (KVPool.compact) where that can make one, else the least
        recently used are evicted one by one until it fits; RESOURCE_EXHAUSTED once none is left."""
        spared, compacted = self._spared(session), False
        while True:
            try:
                return take()
            except PoolFull as full:
                movable = [s.cache for sid, s in self._sessions.items() if sid not in spared]
                blocks = self.prefix.holdings() if self.prefix is not None else []
                if compacted := not compacted and compact(movable, full.pages, blocks):
                    continue
                if self.prefix is not None and self.prefix.evict_pages(full.pages):
                    continue  # blocks' pages before any session
                victim = next((sid for sid in self._sessions if sid not in spared), None)
                if victim is None:
                    raise ResourceExhausted(
                        f"the KV pool has no room left for this call ({full}) and no other session to evict; "
                        "retry later, or raise --max-kv-bytes"
                    ) from None
                self._evict(victim)

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, keep_tokens: int, namespace: str = "") -> KVSession:
        """The session for a call: known ids are resumed; unknown ids start empty, which is
        only valid when the call keeps nothing (keep_tokens == 0), in prefix cache `namespace`."""
        check_opening(session_id, keep_tokens)
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
            return session
        if keep_tokens > 0:
            raise SessionNotFound(
                f"session {session_id!r} is not held here (expired, evicted or the service restarted); "
                "re-send the whole sequence with keep_tokens=0"
            )
        return self._add(session_id, self._with_room(self._cache_factory), namespace)

    def _add(self, session_id: str, cache: Cache | None, namespace: str, forked: bool = False) -> KVSession:
        """A new session holding `cache`, within --max-sessions once idle ones have expired."""
        self.expire()
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"{len(self._sessions)} sessions are open, the configured maximum is {self.max_sessions}; "
                "retry later or raise --max-sessions"
            )
        session = KVSession(session_id, cache=cache, namespace=namespace, forked=forked)
        self._sessions[session_id] = session  # as a fork already: held() may count from the event loop
        return session

    def extend(self, session: KVSession, keep_tokens: int, new_tokens: list[int], scored: int = 1) -> list[int]:
        """KVSession.extend, starting an empty session from the longest prefix of its tokens
        that the prefix cache holds, short of the last `scored` (whose logits the call needs);
        returns the tokens to run. A call that would leave the sequence empty ends the session."""
        if keep_tokens == 0 and not new_tokens:  # a session opened for it is held by nothing
            self.end(session.session_id)
            raise InvalidArgument("the session's sequence is empty; send the prompt as new_tokens")
        if (
            self.prefix is not None
            and session.cache is not None
            and keep_tokens == 0
            and session.cached_tokens == 0
            and session.tree is None
        ):
            cache = self.prefix.lookup(session.namespace, new_tokens, len(new_tokens) - scored)
            if cache is not None:
                hit = cache.get_seq_length()
                if isinstance(pooled := session.cache, PoolCache):  # the blocks copied into the session's extent
                    layers: list = cache.layers
                    try:
                        self._with_room(lambda: pooled.load([(lr.keys, lr.values) for lr in layers]), session)
                    except ResourceExhausted:  # the session, new and empty, is held by nothing
                        self.end(session.session_id)
                        raise
                else:
                    session.cache = cache
                self.prefix.started(hit)
                session.aligned_tokens, session.tokens = hit, list(new_tokens[:hit])
                return session.extend(hit, new_tokens[hit:], scored)
        return session.extend(keep_tokens, new_tokens, scored)

    def for_call(
        self, session_id: str, keep_tokens: int, epoch: int, fork_from: str = "", namespace: str = ""
    ) -> KVSession:
        """The session a numbered Propose call works on: resumed, opened, or forked from
        `fork_from`; a call older than one already served, or than the end of its session
        (`retire`), is refused."""
        if epoch and epoch <= self._retired.get(session_id, 0):
            raise StaleRequest(
                f"session {session_id!r} was ended after call epoch {self._retired[session_id]} was sent; "
                f"call epoch {epoch} reached the service later and opens nothing"
            )
        if fork_from:
            session = self.fork(fork_from, session_id, keep_tokens, epoch)
        else:
            session = self.open(session_id, keep_tokens, namespace)
        session.advance_epoch(epoch)  # first: a stale call takes no branch
        session.forked = session.forked and bool(fork_from)  # a branch taken: its caller continues it
        return session

    def fork(self, parent_id: str, session_id: str, keep_tokens: int, epoch: int) -> KVSession:
        """Opens `session_id` as a copy of the parent's first `keep_tokens` tokens and their
        cache, leaving the parent as it was: a branch that explores one possible outcome.

        A fork numbered (`epoch`) no newer than a call the parent already served is stale: the
        caller has moved on, so nothing is opened (no orphan branch to expire later).
        """
        parent = self._sessions.get(parent_id)
        if parent is None:
            raise SessionNotFound(
                f"session {parent_id!r} to fork from is not held here (expired, evicted or the service restarted)"
            )
        if epoch and epoch <= parent.epoch:
            raise StaleRequest(
                f"fork epoch {epoch} is not newer than epoch {parent.epoch} already served for session {parent_id!r}; "
                "it was superseded"
            )
        if session_id in self._sessions:
            raise InvalidArgument(f"session {session_id!r} already exists; a fork needs a new id")
        if not 0 < keep_tokens <= len(parent.tokens):
            raise InvalidArgument(
                f"keep_tokens={keep_tokens} is outside session {parent_id!r}'s sequence of {len(parent.tokens)} "
                f"tokens; a fork keeps between 1 and {len(parent.tokens)}"
            )
        check_opening(session_id, keep_tokens)
        cache = self._with_room(
            lambda: cache_prefix(parent.cache, keep_tokens) if parent.cache is not None else self._cache_factory(),
            parent,
        )
        session = self._add(session_id, cache, parent.namespace, forked=True)
        session.tokens = parent.tokens[:keep_tokens]
        parent.forked = False  # forked from: its caller's session now (a branch it took)
        if parent.features is not None:
            session.features = parent.features.fork(min(keep_tokens, session.cached_tokens))
        if parent.cache is not None:
            session.aligned_tokens = min(parent.aligned_tokens, session.cached_tokens)
        return session

    def kv_bytes(self) -> int:
        """KV bytes over all sessions and the prefix cache. Safe from another thread (metrics)."""
        held = sum(session.kv_bytes for session in list(self._sessions.values()))
        return held + (self.prefix.bytes if self.prefix is not None else 0)

    def active(self, within_s: float, now: float | None = None) -> int:
        """Sessions used within `within_s` seconds: likely to call again soon, not left idle."""
        now = time.monotonic() if now is None else now
        return sum(1 for session in list(self._sessions.values()) if now - session.last_used <= within_s)

    def forks(self) -> int:  # open sessions still as forked (KVSession.forked): branches not taken
        return sum(1 for session in list(self._sessions.values()) if session.forked)

    def held(self) -> int:  # open sessions less forks: the callers' sessions, the load they make
        return sum(1 for session in list(self._sessions.values()) if not session.forked)

    def ids(self) -> list[str]:
        return list(self._sessions)  # least recently used first

    def peek(self, session_id: str) -> KVSession | None:
        return self._sessions.get(session_id)  # without touching its recency

    def hold(self, session_id: str, extra_bytes: int) -> None:  # a decode batch runs it, to grow by extra_bytes
        self._held[session_id] = extra_bytes

    def grown(self, session_id: str, nbytes: int) -> None:
        """`nbytes` of what the session was held for are in its own cache now, which counts them."""
        if session_id in self._held:
            self._held[session_id] = max(0, self._held[session_id] - nbytes)

    def release(self, session_id: str) -> None:  # the decode batch handed the session its cache back
        self._held.pop(session_id, None)

    def end(self, session_id: str) -> bool:  # a failed pass's cache is not to be trusted
        return self._sessions.pop(session_id, None) is not None

    def retire(self, session_id: str, epoch: int) -> None:
        """Its caller ends the session having sent calls up to `epoch` (0: it numbers none):
        any of them still on its way is refused (`for_call`), though the session may not be
        open yet. A later call (a session that moves back to this replica) opens it again."""
        if epoch:
            self._retired[session_id] = max(epoch, self._retired.pop(session_id, 0))
            while len(self._retired) > RETIRED_KEPT:
                self._retired.popitem(last=False)

    def finish(self, session_id: str) -> bool:
        """Ends a session its caller is done with, keeping its prompt blocks in the prefix cache."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._keep_prefix(session)
        return True

    def _keep_prefix(self, session: KVSession) -> None:
        if self.prefix is not None and session.cache is not None and session.cacheable_tokens:
            self.prefix.insert(session.namespace, session.tokens, session.cache, session.cacheable_tokens)

    def expire(self, now: float | None = None, ttl_s: float | None = None) -> int:
        """Drops sessions idle longer than the TTL (`ttl_s`, else the store's), keeping their
        prompt blocks in the prefix cache; returns how many."""
        now, ttl_s = time.monotonic() if now is None else now, self.ttl_s if ttl_s is None else ttl_s
        stale = [sid for sid, s in self._sessions.items() if now - s.last_used > ttl_s]
        for sid in stale:
            self._keep_prefix(self._sessions.pop(sid))
        return len(stale)


def check_opening(session_id: str, keep_tokens: int) -> None:
    """Before a call opens anything: a bad one opens no session (it would be held till its TTL)."""
    if not session_id:
        raise InvalidArgument("session_id is empty; pass a unique id per generation")
    if keep_tokens < 0:
        raise InvalidArgument(f"keep_tokens={keep_tokens} is negative; it counts the tokens kept, from 0")
