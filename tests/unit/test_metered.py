"""A request whose client deadline passed is counted DEADLINE_EXCEEDED, as its client hears it,
not CANCELLED: gRPC cancels the handler for both, and operators tell timeouts from clients
that left by this label. Each request is counted once, and a first placement is no move."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics, GenerationStats
from coordinator.requests import Chunk
from coordinator.servicer import metered
from coordinator.state import SessionView
from coordinator.upstream import Upstream


async def _waiting():
    await asyncio.sleep(3600)
    yield Chunk(token_ids=[1], text="a")


@pytest.mark.parametrize("expired, code", [(True, "DEADLINE_EXCEEDED"), (False, "CANCELLED")])
async def test_a_cancelled_request_is_counted_by_why_it_was_cancelled(expired, code):
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)

    async def consume():
        async for _ in metered(_waiting(), metrics, lambda: expired):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert registry.get_sample_value("specdec_requests_total", {"finish_reason": "", "code": code}) == 1
    assert registry.get_sample_value("specdec_requests_in_flight") == 0


async def test_a_client_leaving_as_its_last_chunk_is_sent_is_counted_once():
    """The final chunk (with the stats) was counted OK, and the client closing the stream while
    it was written counted the same request CANCELLED too."""
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)

    async def finishing():
        yield Chunk(token_ids=[1], text="a")
        yield Chunk(token_ids=[2], text="b", finish_reason="stop", stats=GenerationStats())
        await asyncio.sleep(0)  # the engine's clean-up after its final chunk

    chunks = metered(finishing(), metrics)
    async for chunk in chunks:
        if chunk.stats is not None:
            break  # the client is gone
    await chunks.aclose()
    assert registry.get_sample_value("specdec_requests_total", {"finish_reason": "stop", "code": "OK"}) == 1
    assert registry.get_sample_value("specdec_requests_total", {"finish_reason": "", "code": "CANCELLED"}) is None
    assert registry.get_sample_value("specdec_requests_in_flight") == 0


def test_a_first_placement_is_no_replica_move():
    """A draft session placed when no draft replica served at the request's start counted a
    move (GenerationStats.replica_moves: after a call to theirs failed)."""
    view = SessionView("s")
    pool = SimpleNamespace(role="draft", place=lambda **kwargs: SimpleNamespace(address="d1:50061"))
    assert Upstream.move(Upstream.__new__(Upstream), pool, view) and view.replica is not None
    assert view.moves == 0
