"""A model with sliding-window attention layers (Qwen2's `use_sliding_window` here) keeps
transformers' own cache, not the pool. A token tree's mask cannot say a window, so such a
model's services serve no trees: Info.trees is false (the coordinator then refuses tree
requests) and a tree call that comes anyway is INVALID_ARGUMENT, not an internal error from a
mask the window's cache does not fit. Chains verify as they do elsewhere."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import DynamicCache

from draft_service.drafter import ProposeCall
from draft_service.runner import DraftRunner
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

WINDOW = 8


@pytest.fixture(scope="module")
def sliding(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sliding")
    shutil.copytree(tiny_pair.target, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, layer_types=None)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_causal_lm(str(folder), "float32", "cpu")
    assert {type(layer).__name__ for layer in DynamicCache(config=loaded.model.config).layers} == {
        "DynamicSlidingWindowLayer"
    }
    return loaded


def call(runner, session_id, keep, new_tokens, drafts=(), parents=()) -> VerifyCall:
    rows = torch.zeros(len(drafts), runner.loaded.vocab_size)
    return VerifyCall(session_id, keep, list(new_tokens), list(drafts), rows, SamplingParams(), 0, parents=parents)


def test_a_sliding_window_model_serves_chains_but_no_trees(sliding):
    runner = TargetRunner(sliding, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    assert runner.pool is None and runner.describe().trees is False
    prompt = [1 + i % 40 for i in range(3 * WINDOW)]  # past the window
    first = runner.verify_one(call(runner, "chain", 0, prompt)).bonus_token_id
    chained = runner.verify_one(call(runner, "chain", len(prompt), [first], drafts=[5, 6]))
    with torch.inference_mode():  # greedy: the target's argmax after the prompt, then after its first token
        logits = sliding.model(torch.tensor([[*prompt, first]])).logits[0, -2:]
    assert [first, chained.recovered_token_ids[0]] == logits.argmax(-1).tolist()
    runner.verify_one(call(runner, "tree", 0, prompt))
    tree = call(runner, "tree", len(prompt), [first], drafts=[5, 6, 7], parents=(0, 0, 1))
    with pytest.raises(InvalidArgument, match="sliding-window"):
        runner.verify_one(tree)
    [refused] = runner.verify_batch([call(runner, "tree2", 0, prompt, drafts=[5, 6], parents=(0, 0))])
    assert isinstance(refused, InvalidArgument)
    assert runner.sessions.peek("tree2") is None  # refused before it opened a session
    draft = DraftRunner(sliding, 4, 60, 8, proposal_top_k=0)
    assert draft.describe().trees is False
    with pytest.raises(InvalidArgument, match="sliding-window"):
        draft.propose_one(ProposeCall("tree3", 0, prompt, 0, SamplingParams(), seed=0, tree_widths=(2, 1)))
    assert draft.sessions.ids() == []
