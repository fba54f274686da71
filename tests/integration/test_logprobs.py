"""GenerateRequest.logprobs through the coordinator: every generated token's log-probability,
and its position's likeliest tokens, equal a plain forward pass's over the output, whatever
drafted it (chains, trees, target-only steps, sampled rounds), and stay one per token through
streaming and stop strings."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = "def add(a, b):"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    async with inprocess_stack(tiny_pair) as running:
        yield running


@pytest.fixture(scope="module")
def plain(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False).input_ids

    def check(response: pb.GenerateResponse, top: int) -> None:
        """Each token's figures against the plain model's log-softmax at its position."""
        tokens = list(response.token_ids)
        assert len(response.logprobs) == len(tokens) > 0
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # [T, V]: predicting each token
        for j, (token, entry) in enumerate(zip(tokens, response.logprobs)):
            assert entry.logprob == pytest.approx(float(expected[j, token]), abs=1e-4), j
            values, ids = expected[j].topk(top)
            assert list(entry.top_token_ids) == ids.tolist(), j
            assert list(entry.top_logprobs) == pytest.approx(values.tolist(), abs=1e-4)

    check.prompt_ids = prompt_ids  # type: ignore[attr-defined]
    return check


@pytest.mark.parametrize(
    "fields",
    [
        {"num_speculative_tokens": 4},
        {"num_speculative_tokens": 0},  # target-only: several steps per Verify call
        {"tree_widths": [2, 1, 1]},
        {"num_speculative_tokens": 3, "temperature": 0.8, "seed": 7},
    ],
    ids=["chain", "target-only", "tree", "sampled"],
)
async def test_each_tokens_logprobs_are_the_targets_own(stack, plain, fields):
    request = pb.GenerateRequest(
        prompt_token_ids=plain.prompt_ids, max_new_tokens=24, logprobs=True, top_logprobs=3, **fields
    )
    response = await stack.stub.Generate(request, timeout=60)
    plain(response, 3)
    without = await stack.stub.Generate(
        pb.GenerateRequest(prompt_token_ids=plain.prompt_ids, max_new_tokens=24, **fields), timeout=60
    )
    assert list(without.token_ids) == list(response.token_ids) and not without.logprobs  # only when asked


async def test_streamed_logprobs_come_one_per_token_and_a_stop_string_cuts_both(stack, plain):
    request = pb.GenerateRequest(
        prompt_token_ids=plain.prompt_ids, max_new_tokens=24, num_speculative_tokens=3, logprobs=True
    )
    chunks = [chunk async for chunk in stack.stub.GenerateStream(request, timeout=60)]
    assert all(len(chunk.logprobs) == len(chunk.token_ids) for chunk in chunks)
    whole = pb.GenerateResponse(
        token_ids=[t for c in chunks for t in c.token_ids], logprobs=[e for c in chunks for e in c.logprobs]
    )
    plain(whole, 0)
    text = "".join(chunk.text for chunk in chunks)
    request.stop.append(text[len(text) // 2 : len(text) // 2 + 2])
    cut = await stack.stub.Generate(request, timeout=60)
    assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.token_ids) < len(whole.token_ids)


@pytest.mark.parametrize("fields", [{"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}])
async def test_bad_top_logprobs_are_refused(stack, fields):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, **fields), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in refused.value.details()
