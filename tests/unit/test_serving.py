"""specdec.rpc.serving's start-up path, without a server."""

from __future__ import annotations

import asyncio
import gc

from specdec.rpc import serving


class _Running:
    frozen_while_serving = -1

    async def serve_until_signal(self, grace_s: float) -> None:
        self.frozen_while_serving = gc.get_freeze_count()


def test_a_service_serves_with_what_start_up_made_out_of_the_collectors_sight(monkeypatch):
    """What `build` made (the model, the tokenizer, their modules) is frozen before the first
    call is served, so no full collection scans it; objects made while serving still are
    collected."""
    gc.unfreeze()
    running = _Running()

    async def build() -> _Running:
        build.made = [[object()] for _ in range(1000)]  # start-up's own objects, kept
        return running

    monkeypatch.setattr(serving.telemetry, "setup_tracing", lambda name: None)
    try:
        asyncio.run(serving.serve_forever(build, "WARNING", "specdec-test"))
        assert running.frozen_while_serving >= 1000
        garbage = []
        garbage.append(garbage)  # a cycle made while serving
        tracked = {id(o) for o in gc.get_objects()}
        assert id(garbage) in tracked, "an object made after start-up must stay in the collector's sight"
    finally:
        gc.unfreeze()
        serving.freeze_start_up_objects()  # as the test session had it (tests/conftest.py)
