"""Which open sessions count as active: the call batcher waits only for those."""

from __future__ import annotations

from specdec.engine.sessions import SessionStore


def test_active_counts_only_sessions_used_recently():
    store = SessionStore(max_sessions=8, ttl_s=300.0, cache_factory=lambda: None)
    for session_id in ("a", "b", "c"):
        store.open(session_id, 0).rollback(0, [1, 2])
    store.open("b", 0).last_used -= 5.0  # idle five seconds
    now = store.open("a", 0).last_used
    assert store.active(1.0, now) == 2
    assert store.active(10.0, now) == 3
    assert store.active(1.0, now + 2.0) == 0 and len(store) == 3  # idle, but still open
