"""RoundRules.live_costs (on by default): a greedy or unseeded request's K follows the services' live pass costs
(Info.live_pass_ms), a seeded sampled request's the calibrated ones, so that a seed keeps one
output while the machine's speed moves under it."""

from __future__ import annotations

from specdec.engine.costs import LIVE_MIN_PASSES, PassCosts
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = "def add(a, b):"


def calibrated_cheap_live_dear(draft_runner, target_runner) -> None:
    """Calibrated: a 1 ms draft step beside a flat 40 ms verify, where speculating pays at any
    acceptance. Live: the draft has since slowed to 400 ms a step, where it never pays. Both
    held still, so the tiny pair's own passes do not move them during the test."""
    draft_runner.pass_costs = PassCosts((1.0,) * 9, context_tokens=128)
    target_runner.pass_costs = PassCosts((40.0,) * 9, context_tokens=128)
    for _ in range(LIVE_MIN_PASSES):
        for n in range(1, 10):
            draft_runner.pass_costs.observe(n, 400.0)
    draft_runner.pass_costs.observe = lambda new_tokens, ms: None
    target_runner.pass_costs.observe = lambda new_tokens, ms: None


async def test_greedy_k_follows_live_costs_and_a_seeded_requests_the_calibrated(tiny_pair, reference):
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, prepare_runners=calibrated_cheap_live_dear
    ) as stack:
        greedy = await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=60)
        assert list(greedy.token_ids) == reference(PROMPT, 24)
        assert not any(greedy.stats.k_per_round), list(greedy.stats.k_per_round)  # live: drafting never pays
        seeded = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24, temperature=0.8, seed=7)
        first = await stack.stub.Generate(seeded, timeout=60)
        assert any(first.stats.k_per_round), list(first.stats.k_per_round)  # calibrated: it pays
        again = await stack.stub.Generate(seeded, timeout=60)
        assert list(again.token_ids) == list(first.token_ids)


async def test_live_costs_off_costs_every_request_as_calibrated(tiny_pair, reference):
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        coordinator_overrides={"live_costs": False},
        prepare_runners=calibrated_cheap_live_dear,
    ) as stack:
        greedy = await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=60)
        assert list(greedy.token_ids) == reference(PROMPT, 24)
        assert any(greedy.stats.k_per_round), list(greedy.stats.k_per_round)
