"""GenerateRequest.logit_bias: the target's distribution is that of its biased logits, so
greedy output, target-only or speculative (chains, trees), equals transformers' generate()
with the same bias (SequenceBiasLogitsProcessor); bad biases are refused by name. The sampled
distribution, and a target that forgets the bias failing it, are in
tests/heavy/test_distribution.py."""

from __future__ import annotations

import re

import grpc
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = "def add(a, b):"
TOKENS = 24


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    async with inprocess_stack(tiny_pair) as running:
        yield running


@pytest.fixture(scope="module")
def transformers_greedy(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    prompt_ids = AutoTokenizer.from_pretrained(tiny_pair.target)(PROMPT, add_special_tokens=False).input_ids

    def generate(bias: dict[int, float]) -> list[int]:
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=TOKENS,
            do_sample=False,
            sequence_bias={(token,): value for token, value in bias.items()} or None,
            pad_token_id=0,
        )
        return out[0, len(prompt_ids) :].tolist()

    generate.prompt_ids = prompt_ids  # type: ignore[attr-defined]
    return generate


async def test_greedy_with_a_bias_is_transformers_greedy_with_it(stack, transformers_greedy):
    plain = transformers_greedy({})
    common = max(set(plain), key=plain.count)
    bias = {common: -100.0, (common + 1) % 200 + 10: 4.0}  # ban the likeliest token, favour another
    expected = transformers_greedy(bias)
    assert expected != plain and common not in expected
    for fields in ({"num_speculative_tokens": 0}, {"num_speculative_tokens": 3}, {"tree_widths": [2, 1]}, {}):
        response = await stack.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=transformers_greedy.prompt_ids, max_new_tokens=TOKENS, logit_bias=bias, **fields
            ),
            timeout=60,
        )
        assert list(response.token_ids)[: len(expected)] == expected, fields


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({100000: 1.0}, "logit_bias names token 100000"),
        ({3: 101.0}, r"logit_bias\[3\] is 101.0"),
        ({i: 1.0 for i in range(301)}, "at most 300"),
    ],
)
async def test_a_bad_bias_is_refused_by_name(stack, bias, message):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, logit_bias=bias), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, refused.value.details()), refused.value.details()
