"""Every drafter of the draft service, through real gRPC servers: greedy output is the
target's own, and the cheap drafters actually propose and get tokens accepted."""

from __future__ import annotations

import grpc
import pytest_asyncio

from specdec.v1 import common_pb2, draft_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

DRAFTERS = {
    "model_float32": {"quantize": "none"},
    "model_int8": {"quantize": "int8"},
    "model_reduced_vocab": {"quantize": "none", "draft_vocab": 128},
    "model_int8_reduced_vocab": {"quantize": "int8", "draft_vocab": 128},
    "ngram": {"drafter": "ngram", "ngram_min": 1, "ngram_max": 4},
    "hybrid": {"drafter": "hybrid", "quantize": "none", "ngram_min": 1, "ngram_max": 4},
}
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    # Repetitive, so the prompt-lookup drafter has something to copy.
    "x = x + 1\nx = x + 1\nx = x + 1\nx = x",
]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=sorted(DRAFTERS))
async def stack(request, tiny_pair):
    async with inprocess_stack(tiny_pair, draft_overrides=DRAFTERS[request.param]) as running:
        running.drafter = request.param
        yield running


async def test_greedy_output_is_the_targets_for_every_drafter(stack, reference):
    accepted = 0
    for prompt in PROMPTS:
        for k in (2, 5):
            response = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=k), timeout=60
            )
            assert list(response.token_ids) == reference(prompt), f"{stack.drafter}, K={k}: diverged on {prompt!r}"
            s = response.stats
            assert s.proposed_tokens <= k * s.rounds and s.accepted_tokens <= s.proposed_tokens
            assert s.generated_tokens == s.accepted_tokens + s.recovered_tokens + s.bonus_tokens
            accepted += s.accepted_tokens
    assert accepted > 0, f"{stack.drafter} never had a token accepted"


async def test_info_names_the_drafter(stack):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        info = await draft_pb2_grpc.DraftStub(channel).Info(common_pb2.InfoRequest())
    if stack.drafter == "ngram":
        assert info.model_id.startswith("ngram[1..4]") and info.dtype == "none"
    elif stack.drafter == "hybrid":
        assert info.model_id.endswith("+lookup[1..4]") and info.dtype == "float32"
    elif "int8" in stack.drafter:
        assert info.dtype == "float32" and info.quantization.startswith("int8")
    else:
        assert info.dtype == "float32" and not info.quantization


async def test_a_pipelined_hybrid_draft_counts_its_copies_wherever_they_come_from(tiny_pair, reference):
    """Pre-drafts may copy too: copied rounds, drafts and accepted copies are counted when a
    round is verified, whichever call drafted it, so each stays within the one before it."""
    prompt = PROMPTS[2]
    async with inprocess_stack(
        tiny_pair, draft_overrides=DRAFTERS["hybrid"], coordinator_overrides={"pipeline": True}
    ) as stack:
        totals = {"copied_rounds": 0, "ready_rounds": 0}
        for k in (2, 4):
            response = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=k), timeout=60
            )
            assert list(response.token_ids) == reference(prompt)
            s = response.stats
            assert s.copied_rounds <= s.rounds and s.copied_rounds <= s.copied_tokens <= s.proposed_tokens
            assert s.copied_accepted <= s.copied_tokens
            assert s.accepted_tokens - s.copied_accepted <= s.proposed_tokens - s.copied_tokens
            totals["copied_rounds"] += s.copied_rounds
            totals["ready_rounds"] += s.ready_rounds
    assert totals["copied_rounds"] > 0 and totals["ready_rounds"] > 0, totals
