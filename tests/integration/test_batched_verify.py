"""Concurrent generations through real gRPC servers whose target batches Verify calls and whose
draft batches Propose calls."""

from __future__ import annotations

import asyncio
import time

import pytest_asyncio

from specdec.rpc.model_thread import ACTIVE_SESSION_S
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

# Different prompt lengths, output lengths and K, so the batched passes mix pasts and runs of
# new tokens of different lengths (and prompt prefills with decode rounds).
REQUESTS = [
    ("def add(a, b):", 40, 4),
    ("The quick brown fox", 32, 2),
    ("SELECT name, count(*) FROM users GROUP BY name", 36, 3),
    ("Speculative decoding drafts tokens", 28, 5),
    ("for i in range(10):\n", 40, 1),
    ("Résumé: naïve café", 24, 3),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    # A window far longer than a tiny verify, so concurrent calls reliably meet.
    batching = {"batch_window_ms": 20.0, "max_batch_size": 8}
    # A float32 draft: batched passes equal lone ones to float32 rounding, which an int8 draft
    # could now and then turn into a quantisation step (still exact: each token is sent with
    # the distribution it was drawn from), and the seeded comparison below needs equality.
    draft = {**batching, "quantize": "none"}
    async with inprocess_stack(tiny_pair, draft_overrides=draft, target_overrides=batching) as running:
        yield running


def generate_request(prompt: str, tokens: int, k: int, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, num_speculative_tokens=k, **fields)


async def test_concurrent_greedy_requests_are_batched_and_token_identical(stack, reference):
    runner = stack.target_runner
    passes_before, processed_before = runner.batched_forwards, runner.processed_tokens_total
    draft_passes_before = stack.draft_runner.batched_forwards
    responses = await asyncio.gather(
        *(stack.stub.Generate(generate_request(*request), timeout=120) for request in REQUESTS)
    )
    for (prompt, tokens, k), response in zip(REQUESTS, responses):
        assert list(response.token_ids) == reference(prompt, tokens), (
            f"{prompt!r} (K={k}) diverged from the target's greedy output"
        )
    assert runner.batched_forwards > passes_before, "no Verify call shared a forward pass"
    assert runner.max_batch_size_seen > 1
    assert stack.draft_runner.batched_forwards > draft_passes_before, "no Propose step shared a forward pass"
    # Batching pads passes but never recomputes a prefix: the prompt once, then each round's new token and drafts.
    expected = sum(r.stats.prompt_tokens + r.stats.proposed_tokens + r.stats.rounds - 1 for r in responses)
    assert runner.processed_tokens_total - processed_before == expected


async def test_concurrent_seeded_sampling_matches_each_request_alone(stack):
    """Sampled rounds draw from target probabilities that batching changes only by float32
    rounding, so with fixed seeds each output equals the same request run alone."""
    requests = [
        generate_request(prompt, tokens, k, temperature=0.8, seed=7 + i)
        for i, (prompt, tokens, k) in enumerate(REQUESTS)
    ]
    alone = [await stack.stub.Generate(request, timeout=60) for request in requests]
    passes_before, draft_passes_before = stack.target_runner.batched_forwards, stack.draft_runner.batched_forwards
    together = await asyncio.gather(*(stack.stub.Generate(request, timeout=120) for request in requests))
    assert stack.target_runner.batched_forwards > passes_before
    assert stack.draft_runner.batched_forwards > draft_passes_before
    for request, lone, batched in zip(requests, alone, together):
        assert list(batched.token_ids) == list(lone.token_ids), request.prompt


async def test_a_lone_request_does_not_wait_for_the_window(stack, reference):
    prompt, tokens, k = REQUESTS[0]
    response = await stack.stub.Generate(generate_request(prompt, tokens, k), timeout=60)
    assert list(response.token_ids) == reference(prompt, tokens)
    # With no other session open, a Verify or Propose starts at once instead of waiting 20 ms for
    # company: the time a round spends in calls outside the model's work stays below the window
    # (the model's own work is left out: on busy cores it alone can take 20 ms).
    stats = response.stats
    assert stats.target_ms - stats.target_compute_ms < stats.rounds * 20.0
    assert stats.draft_ms - stats.draft_compute_ms < stats.rounds * 20.0


async def test_a_lone_generation_does_not_wait_for_sessions_left_open_and_idle(tiny_pair):
    """A call waits for company only from sessions active in the last second: beside a session
    left open and idle, a lone generation's calls run at once instead of waiting the window."""
    window_ms = 300.0
    batching = {"batch_window_ms": window_ms, "max_batch_size": 8, "quantize": "none"}
    async with inprocess_stack(tiny_pair, draft_overrides=batching, target_overrides=batching) as stack:
        for runner in (stack.draft_runner, stack.target_runner):
            idle = runner.sessions.open("idle-client", 0)
            idle.last_used -= 10 * ACTIVE_SESSION_S  # left open, unused for a while
        started = time.perf_counter()
        response = await stack.stub.Generate(generate_request("def add(a, b):", 8, 2), timeout=60)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        rounds = response.stats.rounds
        # Each round makes a Propose and a Verify call: waiting the window would cost at least
        # 2 x 300 ms a round.
        assert elapsed_ms < rounds * window_ms, f"{rounds} rounds took {elapsed_ms:.0f} ms"
        assert len(stack.target_runner.sessions) >= 1  # the idle session was there throughout
