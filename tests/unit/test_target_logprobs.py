"""Log-probabilities from a verify (VerifyCall.top_logprobs): each position's figures equal a
plain forward pass's log-softmax at that position, for a chain, a tree and the greedy fast
path, with the likeliest tokens in order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.sampling.probs import SamplingParams
from target_service.runner import VerifyCall

PROMPT = [10, 20, 30, 40]
SAMPLED = SamplingParams(temperature=0.8, top_k=5)  # logprobs stay raw: temperature 1, no top-k
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def plain(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()

    def logprobs_after(tokens: list[int]) -> torch.Tensor:
        """[V]: log-softmax of the plain model's next-token logits after `tokens`."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)

    return logprobs_after


def drafts_for(runner, tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """Uniform draft distributions: every draft token has mass, so the round may accept it."""
    vocab = runner.loaded.vocab_size
    return torch.full((len(tokens), vocab), 1.0 / vocab)


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_chains_logprobs_are_a_plain_forwards(target_runner, plain, params):
    drafts = [7, 8, 9]
    call = VerifyCall("chain", 0, PROMPT, drafts, drafts_for(target_runner, drafts, params), params, 3, top_logprobs=4)
    result = target_runner.verify_one(call)
    target_runner.end_session("chain")
    assert result.logprobs is not None
    row_tokens = [*result.recovered_token_ids, result.bonus_token_id]
    for row in range(len(drafts) + 1):
        expected = plain(PROMPT + drafts[:row])
        if row < len(drafts):
            assert result.logprobs.draft[row] == pytest.approx(float(expected[drafts[row]]), abs=1e-4)
        assert result.logprobs.rows[row] == pytest.approx(float(expected[row_tokens[row]]), abs=1e-4)
        top, top_ids = expected.topk(4)
        assert result.logprobs.top_ids[row] == top_ids.tolist()
        assert result.logprobs.top[row] == pytest.approx(top.tolist(), abs=1e-4)


def test_a_trees_logprobs_are_each_paths_plain_forward(target_runner, plain):
    drafts, parents = [7, 8, 9], (0, 0, 1)  # two children of the root, one below the first
    call = VerifyCall(
        "tree",
        0,
        PROMPT,
        drafts,
        drafts_for(target_runner, drafts, SAMPLED),
        SAMPLED,
        5,
        parents=parents,
        top_logprobs=2,
    )
    result = target_runner.verify_one(call)
    target_runner.end_session("tree")
    assert result.logprobs is not None
    paths = [[], [7], [8], [7, 9]]  # the tokens after the prompt up to each node, root first
    for node, path in enumerate(paths):
        expected = plain(PROMPT + path)
        assert result.logprobs.rows[node] == pytest.approx(float(expected[result.recovered_token_ids[node]]), abs=1e-4)
        assert result.logprobs.top_ids[node] == expected.topk(2).indices.tolist()
    for i, (token, parent) in enumerate(zip(drafts, parents)):
        assert result.logprobs.draft[i] == pytest.approx(float(plain(PROMPT + paths[parent])[token]), abs=1e-4)


def test_no_logprobs_unless_asked_and_none_beyond_the_tokens_with_top_0(target_runner):
    call = VerifyCall("off", 0, PROMPT, [], torch.zeros(0, target_runner.loaded.vocab_size), GREEDY, 1)
    assert target_runner.verify_one(call).logprobs is None
    target_runner.end_session("off")
    result = target_runner.verify_one(VerifyCall("on", 0, PROMPT, [], call.draft_probs, GREEDY, 1, top_logprobs=0))
    target_runner.end_session("on")
    assert result.logprobs is not None and result.logprobs.top_ids == [[]] and len(result.logprobs.rows) == 1
