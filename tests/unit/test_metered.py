"""A request whose client deadline passed is counted DEADLINE_EXCEEDED, as its client hears it,
not CANCELLED: gRPC cancels the handler for both, and operators tell timeouts from clients
that left by this label."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from coordinator.requests import Chunk
from coordinator.servicer import metered


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
