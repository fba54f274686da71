"""retry_unavailable's back-off: doubling from its start, capped at 1 s, each wait a random
half to all of that (coordinators that lost one target together do not retry it in step),
and never a retry after a missed deadline."""

from __future__ import annotations

import pytest

from coordinator import upstream
from coordinator.clients import retry_unavailable
from specdec.errors import DeadlineExceeded, Unavailable


async def test_waits_double_up_to_a_second_each_jittered(monkeypatch):
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(upstream.asyncio, "sleep", sleep)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 8:
            raise Unavailable("down")
        return "up"

    for _ in range(20):
        waits.clear()
        calls = 0
        assert await retry_unavailable(flaky, give_up=lambda attempts: attempts >= 10, backoff_s=0.2) == "up"
        caps = [min(0.2 * 2**n, 1.0) for n in range(7)]
        assert len(waits) == 7 and all(cap / 2 <= wait <= cap for wait, cap in zip(waits, caps)), waits
    assert len({round(w, 6) for w in waits}) > 1  # jittered, not fixed


async def test_a_missed_deadline_and_giving_up_are_not_retried(monkeypatch):
    async def sleep(seconds: float) -> None:
        raise AssertionError("no wait expected")

    monkeypatch.setattr(upstream.asyncio, "sleep", sleep)

    async def late() -> None:
        raise DeadlineExceeded("late")

    with pytest.raises(DeadlineExceeded):
        await retry_unavailable(late, give_up=lambda attempts: False, backoff_s=0.1)

    async def down() -> None:
        raise Unavailable("down")

    with pytest.raises(Unavailable):
        await retry_unavailable(down, give_up=lambda attempts: attempts >= 1, backoff_s=0.1)


async def test_a_first_failure_moves_to_another_replica_whatever_the_window():
    """`on_failure` finding another replica goes on at once, even where the retry window is 0
    (--connect-timeout 0): failing over is no wait. Where it finds none, the window decides,
    and past the window nothing moves again (replicas a refresh keeps marking serving while
    their calls fail are not moved between for ever)."""
    replicas = ["gone", "up"]

    async def call() -> str:
        if replicas[0] == "gone":
            raise Unavailable("gone")
        return replicas[0]

    def move() -> bool:
        if len(replicas) == 1:
            return False
        replicas.pop(0)
        return True

    assert await retry_unavailable(call, give_up=lambda attempts: True, backoff_s=0.1, on_failure=move) == "up"
    replicas[:] = ["gone"]
    with pytest.raises(Unavailable):
        await retry_unavailable(call, give_up=lambda attempts: True, backoff_s=0.1, on_failure=move)
    moves = []
    with pytest.raises(Unavailable):  # every replica fails, and each always seems to serve
        await retry_unavailable(
            call, give_up=lambda attempts: True, backoff_s=0.1, on_failure=lambda: not moves.append(1)
        )
    assert len(moves) == 1
