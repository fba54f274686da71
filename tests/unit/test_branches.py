"""coordinator.branches: what happens to a branch call's forks when no round takes them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from coordinator.branches import BranchCall, Branches, BranchPlan
from coordinator.hedging import Hedge


async def test_the_forks_of_a_call_dropped_as_the_request_ends_end_as_no_output():
    """A branch call in flight when its request ends (finished, failed or its client gone) is
    dropped; its forks (hedges, bonus guesses) hold drafts nobody verified. Ended without
    `discard`, a suffix drafter's store learned their assumed tokens as output."""
    ended = []

    class Upstream:
        def end_later(self, client, session_id, discard=False, then=None, epoch=0, committed=None) -> None:
            ended.append((session_id, discard, epoch))

    plans = [BranchPlan(2, "request"), BranchPlan(2, "guess", guess_rank=1), BranchPlan(2, "hedge", Hedge(0, 7, 0.5))]
    task = asyncio.get_running_loop().create_future()
    call = BranchCall(3, plans, task, SimpleNamespace(client=None), epoch=9)  # type: ignore[arg-type]
    Branches(Upstream()).drop(call)  # type: ignore[arg-type]
    assert ended == [("guess", True, 9), ("hedge", True, 9)] and task.cancelled()
