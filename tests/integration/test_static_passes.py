"""Both model services with --cuda-graphs on (on CPU: the static passes uncaptured) through
real gRPC servers: greedy output is the target's own, alone, batched and with trees; seeded
sampling gives what the same services give with every pass eager."""

from __future__ import annotations

import asyncio

import pytest_asyncio

from specdec.engine.calibration import calibrate_costs
from specdec.v1 import coordinator_pb2 as pb
from tests.integration.test_batched_verify import REQUESTS, generate_request
from tests.stack import inprocess_stack


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    batching = {"batch_window_ms": 20.0, "max_batch_size": 8, "cuda_graphs": "on"}
    async with inprocess_stack(
        tiny_pair, draft_overrides={**batching, "quantize": "none"}, target_overrides=batching
    ) as running:
        assert running.target_runner.static is not None and running.draft_runner.static is not None
        yield running


def runs(runner) -> dict:
    """Passes run so far by bucket (sessions, tokens, length)."""
    return {bucket: entry.runs for bucket, entry in runner.static._passes.items()}


def more(after: dict, before: dict) -> set:
    return {bucket for bucket, count in after.items() if count > before.get(bucket, 0)}


async def test_greedy_output_is_the_targets_alone_batched_and_with_trees(stack, reference):
    target, draft = stack.target_runner, stack.draft_runner
    before, draft_before = runs(target), runs(draft)
    responses = await asyncio.gather(
        *(stack.stub.Generate(generate_request(*request), timeout=120) for request in REQUESTS)
    )
    for (prompt, tokens, k), response in zip(REQUESTS, responses):
        assert list(response.token_ids) == reference(prompt, tokens), f"{prompt!r} (K={k}) diverged"
    ran = more(runs(target), before)
    assert any(bucket.sessions > 1 for bucket in ran), f"no batched verify ran as a static pass: {ran}"
    assert any(bucket.tokens > 1 for bucket in ran) and more(runs(draft), draft_before)
    before = runs(target)
    for prompt, tokens, _ in REQUESTS[:3]:
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, tree_widths=[2, 2]), timeout=60
        )
        assert list(response.token_ids) == reference(prompt, tokens), f"{prompt!r} with a tree diverged"
    assert any(bucket.tokens >= 7 for bucket in more(runs(target), before))  # root's run + 6 nodes


async def test_seeded_sampling_is_what_eager_passes_give(stack):
    """Static and eager passes differ by float32 rounding only: with fixed seeds, the same
    outputs, alone and batched."""
    requests = [
        generate_request(prompt, tokens, k, temperature=0.8, seed=11 + i)
        for i, (prompt, tokens, k) in enumerate(REQUESTS)
    ]
    static = await asyncio.gather(*(stack.stub.Generate(request, timeout=120) for request in requests))
    held = stack.target_runner.static, stack.draft_runner.static
    stack.target_runner.static = stack.draft_runner.static = None
    try:
        eager = [await stack.stub.Generate(request, timeout=60) for request in requests]
    finally:
        stack.target_runner.static, stack.draft_runner.static = held
    for request, a, b in zip(requests, static, eager):
        assert list(a.token_ids) == list(b.token_ids), request.prompt


async def test_calibration_times_the_passes_as_served(stack):
    """Start-up calibration times static passes where they are what runs, batched ones too."""
    runner = stack.target_runner
    before = runs(runner)
    costs = await asyncio.to_thread(calibrate_costs, runner, True)
    timed = more(runs(runner), before)
    assert costs.batch_ms and {(b.sessions, b.tokens) for b in timed} >= {(1, 1), (2, 1), (8, 1)}, timed
