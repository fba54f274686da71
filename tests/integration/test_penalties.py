"""Penalties (GenerateRequest.presence_penalty, frequency_penalty, repetition_penalty): the
target's distribution is that of its penalised logits, so greedy output with speculation is
target-only's, and with repetition_penalty transformers' generate()'s; out-of-range values and
trees are refused by name. The sampled distribution, and a target that forgets the drafts
before a row, are in tests/heavy/test_distribution.py."""

from __future__ import annotations

import re

import grpc
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = "for i in range(10):\n"
TOKENS = 32
SPECULATIVE = ({"num_speculative_tokens": 0}, {"num_speculative_tokens": 3}, {})  # {}: the K chooser


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    async with inprocess_stack(tiny_pair) as running:
        yield running


@pytest.fixture(scope="module")
def prompt_ids(tiny_pair) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_pair.target)(PROMPT, add_special_tokens=False).input_ids


async def greedy(stack, prompt_ids: list[int], **fields) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_new_tokens=TOKENS, **fields)
    return list((await stack.stub.Generate(request, timeout=60)).token_ids)


async def test_repetition_penalty_is_transformers_greedy_with_it(stack, tiny_pair, prompt_ids):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=TOKENS, do_sample=False, repetition_penalty=1.5, pad_token_id=0
    )
    expected = out[0, len(prompt_ids) :].tolist()
    assert expected != await greedy(stack, prompt_ids)
    for fields in SPECULATIVE:
        got = await greedy(stack, prompt_ids, repetition_penalty=1.5, **fields)
        assert got[: len(expected)] == expected, fields


async def test_presence_and_frequency_penalties_keep_greedy_the_targets_own(stack, prompt_ids):
    plain = await greedy(stack, prompt_ids, num_speculative_tokens=0)
    reference = await greedy(stack, prompt_ids, num_speculative_tokens=0, presence_penalty=0.8, frequency_penalty=1.2)
    assert reference != plain and len(set(reference)) > len(set(plain))  # fewer repeats
    for fields in SPECULATIVE[1:]:
        assert await greedy(stack, prompt_ids, presence_penalty=0.8, frequency_penalty=1.2, **fields) == reference


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 10\]"),
        ({"repetition_penalty": 1e-40}, r"repetition_penalty must be in \[0.01, 10\]"),  # logits / it: inf
        ({"frequency_penalty": 0.5, "tree_widths": [2, 1]}, "penalties do not apply to token trees"),
    ],
)
async def test_bad_penalties_are_refused_by_name(stack, fields, message):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, **fields), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, refused.value.details()), refused.value.details()
