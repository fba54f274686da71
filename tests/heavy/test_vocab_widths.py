"""A draft and a target whose logits differ in width (issue 17, item 3), as real pairs' do:
Qwen2.5-0.5B has 151,936 columns and Qwen2.5-7B 152,064, more than the tokenizer's ids.

- A wider target samples ids the draft cannot embed: the coordinator sends the draft a
  stand-in id for them, and the request goes on.
- A wider draft is told the target's width (ProposeRequest.vocab_limit) and proposes only ids
  the target has, drawing from its distribution with the others at probability 0.

Either way greedy output is the target's own, sampled output has the target's distribution,
and no request fails."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.sampling.probs import SamplingParams
from specdec.tools.testing import build_pair, word_tokenizer
from specdec.v1 import coordinator_pb2 as pb
from tests.heavy.test_distribution import (
    LOCAL_BATCH,
    LOCAL_CONCURRENCY,
    SAMPLES,
    exact_target_distribution,
    sample_continuations,
)
from tests.stack import local_stack
from tests.stats import P_VALUE_FLOOR, chi_square_p_value

WORDS = 12
EXTRA = 4
PROMPT = [3, 7]
LENGTH = 3


@pytest.fixture(scope="module", params=["wider target", "wider draft"])
def pair(request, tmp_path_factory):
    extra = {"target_extra_vocab": EXTRA} if request.param == "wider target" else {"draft_extra_vocab": EXTRA}
    built = build_pair(
        tmp_path_factory.mktemp("widths"), word_tokenizer(WORDS), logit_scale=1.5, noise=0.6, eos=False, **extra
    )
    return request.param, built


def target_greedy(pair, prompt: list[int], length: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=length, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


async def test_greedy_output_is_the_targets_and_nothing_fails(pair):
    kind, built = pair
    prompts = [[3, 7], [1, 2, 3], [11, 4], [5, 5, 9], [0, 8]]
    async with local_stack(built, draft_overrides={"quantize": "none"}) as stack:
        wide = 0
        for prompt in prompts:
            expected = target_greedy(built, prompt, 24)
            for k in (0, 2, 4):
                response = await stack.stub.Generate(
                    pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=24, num_speculative_tokens=k), timeout=60
                )
                assert list(response.token_ids) == expected, f"{kind}, K={k}, prompt {prompt}"
            wide += sum(token >= WORDS for token in expected)
    if kind == "wider target":
        assert wide > 0, "the target never chose an id the draft lacks; the case tests nothing new"


async def test_sampled_output_has_the_targets_distribution(pair):
    kind, built = pair
    params = SamplingParams(temperature=1.0)
    # The word tokenizer gains an EOS at id 12 when saved and loaded, which only the wider
    # target can emit: a generation that draws it ends there.
    eos = AutoTokenizer.from_pretrained(built.target).eos_token_id
    expected = exact_target_distribution(built.target, params, built.vocab_size, PROMPT, LENGTH, eos_token_ids=(eos,))
    overrides = {**LOCAL_BATCH, "quantize": "none"}
    async with local_stack(built, draft_overrides=overrides, target_overrides=LOCAL_BATCH) as stack:
        stats: list = []
        samples = await sample_continuations(
            stack.stub, params, range(SAMPLES), PROMPT, LENGTH, 2, stats, concurrency=LOCAL_CONCURRENCY
        )
    assert sum(s.accepted_tokens for s in stats) > 0
    if kind == "wider target":
        assert any(token > WORDS for sample in samples for token in sample), "no id past the draft's width was drawn"
    else:
        assert all(token < WORDS for sample in samples for token in sample)
    p_value = chi_square_p_value(samples, expected)
    assert p_value > P_VALUE_FLOOR, f"{kind}: χ² p-value {p_value:.2e}; output is not the target's distribution"
