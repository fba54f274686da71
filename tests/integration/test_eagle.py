"""The EAGLE drafter (issue 68) through the real servicers: greedy output is the target's own
in every coordinator mode, with heads in both released layouts, and the target's features
reach the head's sessions with the next call."""

from __future__ import annotations

import pytest
import pytest_asyncio

from specdec.engine.eagle import EAGLE1, EAGLE3
from specdec.tools.testing import build_eagle_head
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import local_stack

PROMPTS = ["def add(a, b):", "The quick brown fox"]
MODES = {
    "sequential": {},
    "pipelined": {"pipeline": True},
    "hedged": {"pipeline": True, "hedges": 2, "bonus_guesses": 2},
    "adaptive": {"pipeline": False},
}


@pytest.fixture(scope="module", params=[EAGLE1, EAGLE3])
def head(request, tiny_pair, tmp_path_factory):
    draft_vocab = 96 if request.param == EAGLE3 else 0
    return build_eagle_head(
        tmp_path_factory.mktemp(request.param), tiny_pair.target, request.param, draft_vocab=draft_vocab
    )


@pytest_asyncio.fixture(loop_scope="session", params=sorted(MODES))
async def stack(request, tiny_pair, head):
    draft = {"model": str(tiny_pair.target), "drafter": "eagle", "draft_head": str(head), "quantize": "none"}
    async with local_stack(tiny_pair, draft_overrides=draft, coordinator_overrides=MODES[request.param]) as running:
        running.mode = request.param
        yield running


async def test_greedy_output_is_the_targets_with_an_eagle_head(stack, reference):
    k = None if stack.mode == "adaptive" else 3
    proposed = 0
    for prompt in PROMPTS:
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=24, num_speculative_tokens=k), timeout=60
        )
        assert list(response.token_ids) == reference(prompt, 24), f"{stack.mode}: diverged on {prompt!r}"
        assert response.stats.branch_failures == 0, f"{stack.mode}: the head failed a branch"
        # A random head is rarely right: pipelined rounds then run as catch-up steps whose
        # pre-drafts miss, and their drafts count as pre-drafted.
        proposed += response.stats.proposed_tokens + response.stats.predrafted_tokens
    runner = stack.draft_runner
    assert proposed > 0, "the head never drafted"
    # Every call after a verify brings that verify's rows; the prompt's come with the second.
    assert runner.received_feature_rows >= sum(len(p) for p in PROMPTS), runner.received_feature_rows
    assert runner.describe().trees is False and runner.describe().feature_layers
