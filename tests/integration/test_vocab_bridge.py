"""A draft with another tokenizer (issue 38: token-level intersection) through the services:
greedy output is the target's own, tokens the draft cannot propose are still emitted, the
pair is checked at start-up, and a proposal outside the intersection is verified like any
draft (or fails the request when its own distribution gives it no mass)."""

from __future__ import annotations

import grpc
import pytest

from draft_service.vocab_bridge import VocabBridge
from specdec.errors import InvalidArgument
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack, local_stack

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "x = x + 1\nx = x + 1\nx = x + 1\nx = x",
]
DRAFTERS = {
    "model": {"quantize": "none"},
    "model_int8": {"quantize": "int8"},
    "hybrid": {"drafter": "hybrid", "quantize": "none", "ngram_min": 1},
    "suffix": {"drafter": "suffix", "quantize": "none", "ngram_min": 1},
    # Prompt blocks cached in the draft's own tokens: every request after the first hits.
    "model_prefix_cache": {"quantize": "none", "prefix_cache_bytes": 1 << 22, "prefix_block_tokens": 4},
}


def bridged(pair, **overrides) -> dict:
    return {"target_tokenizer": str(pair.target), **overrides}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
async def test_greedy_output_is_the_targets_and_unshared_tokens_are_emitted(bridged_pair, reference, drafter):
    async with local_stack(bridged_pair, draft_overrides=bridged(bridged_pair, **DRAFTERS[drafter])) as stack:
        bridge: VocabBridge = stack.draft_runner.bridge
        shared = set(bridge.caller_ids.tolist())
        accepted = unshared = 0
        for prompt in PROMPTS:
            for k in (2, 5):
                response = await stack.stub.Generate(
                    pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=k), timeout=60
                )
                assert list(response.token_ids) == reference(prompt), f"{drafter}, K={k}: diverged on {prompt!r}"
                assert response.stats.draft_failures == 0
                accepted += response.stats.accepted_tokens
                unshared += sum(token not in shared for token in response.token_ids)
    assert accepted > 0, "no draft token was accepted"
    if "prefix_cache_bytes" in DRAFTERS[drafter]:
        assert stack.draft_runner.sessions.prefix.hits > 0, "no draft session started from cached blocks"
    assert unshared > 0, "the target never emitted a token the draft cannot propose; the test misses that path"


async def test_pipelined_hedged_sampled_requests_through_a_bridged_draft(bridged_pair):
    """Pre-drafts, hedges (forks) and sampled proposals over the wire; a seed gives one output."""
    async with inprocess_stack(
        bridged_pair,
        draft_overrides=bridged(bridged_pair, quantize="none"),
        coordinator_overrides={"pipeline": True, "hedges": 1},
    ) as stack:
        outputs = []
        for _ in range(2):
            response = await stack.stub.Generate(
                pb.GenerateRequest(
                    prompt=PROMPTS[0], max_new_tokens=32, num_speculative_tokens=3, temperature=1.0, seed=11
                ),
                timeout=60,
            )
            assert response.stats.draft_failures == 0 and response.stats.proposed_tokens > 0
            outputs.append(list(response.token_ids))
    assert outputs[0] == outputs[1]


async def test_the_coordinator_refuses_a_pair_below_its_minimum_overlap(bridged_pair):
    with pytest.raises(InvalidArgument, match=r"shares \d+ tokens with target .*the coordinator asks for at least"):
        async with local_stack(
            bridged_pair,
            draft_overrides=bridged(bridged_pair, quantize="none"),
            coordinator_overrides={"min_vocab_overlap": 0.99},
        ):
            pass


async def test_without_target_tokenizer_the_pair_is_refused_with_the_way_out(bridged_pair):
    with pytest.raises(InvalidArgument, match="draft and target tokenizers differ.*--target-tokenizer"):
        async with local_stack(bridged_pair, draft_overrides={"quantize": "none"}):
            pass


async def test_a_proposal_outside_the_intersection_is_verified_like_any_draft(bridged_pair, reference):
    """A buggy or hostile draft proposes a target id it does not share: greedy, its rows are
    one-hot at that id, so the target verifies it as any draft (accepted only where it is the
    target's own choice), the output is the target's, and the foreign drafts are counted.
    Sampled, its rows give the id no mass: that reply cannot be verified exactly, so the
    request fails with INTERNAL naming the token, and the next request is served as before."""
    async with local_stack(bridged_pair, draft_overrides=bridged(bridged_pair, quantize="none")) as stack:
        runner = stack.draft_runner
        shared = set(runner.bridge.caller_ids.tolist())
        foreign = next(i for i in range(runner.bridge.caller_vocab_size) if i not in shared)
        plain = runner._caller_id
        runner._caller_id = lambda row: foreign
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=24, num_speculative_tokens=3), timeout=60
        )
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stack.stub.Generate(
                pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=8, num_speculative_tokens=3, temperature=1.0),
                timeout=60,
            )
        runner._caller_id = plain
        after = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=24, num_speculative_tokens=3), timeout=60
        )
    assert list(response.token_ids) == reference(PROMPTS[1], 24)
    assert response.stats.foreign_tokens == response.stats.proposed_tokens > 0
    assert response.stats.draft_failures == 0 and response.stats.fallback_rounds == 0
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert f"proposed token {foreign} at position 0 with probability 0.0" in failed.value.details()
    assert list(after.token_ids) == reference(PROMPTS[1], 24) and after.stats.foreign_tokens == 0


async def test_a_sequence_too_long_in_the_drafts_own_tokens_runs_target_only_for_that_request(bridged_pair, reference):
    """The draft spells some target tokens with several of its own, so a request can reach the
    draft's context before the target's: the draft refuses that request (RESOURCE_EXHAUSTED),
    its rounds run target-only with the same output, and the next request drafts as before
    (the breaker other requests share is untouched)."""
    line = "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC; "  # 37 target tokens, 62 draft
    draft = bridged(bridged_pair, quantize="none")
    async with local_stack(bridged_pair, draft_overrides=draft, coordinator_overrides={"breaker_failures": 1}) as stack:
        bridge: VocabBridge = stack.draft_runner.bridge
        tokenizer = bridge.caller.tokenizer
        prompt = line * 5
        ids = tokenizer.encode(prompt)
        assert len(ids) + 40 < 256 < len(bridge.to_draft(ids, 0)[0]) + 40, "the prompt must overflow only the draft"
        long = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=4), timeout=60
        )
        short = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=24, num_speculative_tokens=4), timeout=60
        )
    assert list(long.token_ids) == reference(prompt)
    assert long.stats.draft_failures > 0 and long.stats.fallback_rounds > 0
    assert list(short.token_ids) == reference(PROMPTS[0], 24)
    assert short.stats.draft_failures == 0 and short.stats.proposed_tokens > 0
