"""Which open sessions count as active: the call batcher waits only for those."""

from __future__ import annotations

import pytest

from specdec.engine.sessions import SessionStore
from specdec.errors import StaleRequest


def test_active_counts_only_sessions_used_recently():
    store = SessionStore(max_sessions=8, ttl_s=300.0, cache_factory=lambda: None)
    for session_id in ("a", "b", "c"):
        store.open(session_id, 0).rollback(0, [1, 2])
    store.open("b", 0).last_used -= 5.0  # idle five seconds
    now = store.open("a", 0).last_used
    assert store.active(1.0, now) == 2
    assert store.active(10.0, now) == 3
    assert store.active(1.0, now + 2.0) == 0 and len(store) == 3  # idle, but still open


def test_held_sessions_leave_out_forks_but_not_a_fork_its_caller_forks_from():
    """`held` (ModelInfo.open_sessions less fork_sessions, and every reply's held_sessions) is
    the load callers make: their hedges' forks are not, but a fork a caller took is its
    session, also where the caller's next call only forks from it (a round of hedges alone)."""
    store = SessionStore(max_sessions=8, ttl_s=300.0, cache_factory=lambda: None)
    store.open("request", 0).rollback(0, [1, 2, 3])
    store.fork("request", "hedge", 2, epoch=0)
    store.fork("request", "guess", 3, epoch=0)
    assert (store.held(), store.forks(), len(store)) == (1, 2, 3)
    store.fork("hedge", "next-hedge", 2, epoch=0)  # the hedge was taken: the request's session now
    assert (store.held(), store.forks()) == (2, 2)


def test_a_stale_call_on_a_fork_leaves_it_a_fork():
    """A call on a fork that is refused as stale took no branch: it used to clear the fork's
    mark first, so Info counted one fork fewer and one held session more for its life."""
    store = SessionStore(max_sessions=8, ttl_s=300.0, cache_factory=lambda: None)
    store.for_call("request", 0, epoch=1).rollback(0, [1, 2, 3])
    store.for_call("hedge", 2, epoch=2, fork_from="request")
    assert (store.held(), store.forks()) == (1, 1)
    with pytest.raises(StaleRequest):
        store.for_call("hedge", 2, epoch=2)
    assert (store.held(), store.forks()) == (1, 1)
    store.for_call("hedge", 2, epoch=3)  # taken
    assert (store.held(), store.forks()) == (2, 0)
