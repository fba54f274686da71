"""One pass over a token tree scores every branch as a plain forward would, and keeping the
accepted path leaves the cache of the committed sequence (specdec.tree_pass)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specdec import attention
from specdec.tree_pass import keep_tree_path, tree_forward
from specdec.tree_sampling import ancestors

PROMPT = [3, 7, 11, 5, 2]
NEW = [9, 4]  # committed tokens the cache has not seen yet; the last one is the tree's root
TOKENS = [8, 9, 1, 2, 4, 6, 12]
PARENTS = [0, 0, 1, 1, 2, 2, 4]  # nodes 1..7: two levels of two, and node 7 below node 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(config).eval()


def prefilled(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([PROMPT]), past_key_values=cache)
    return cache


def plain_next_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([sequence])).logits[0, -1]


def test_every_node_scores_as_a_plain_forward_over_its_path(model):
    cache = prefilled(model)
    logits = tree_forward(model, cache, NEW, TOKENS, PARENTS)  # [N + 1, V]
    assert logits.shape == (len(TOKENS) + 1, model.config.vocab_size)
    committed = PROMPT + NEW
    torch.testing.assert_close(logits[0], plain_next_logits(model, committed), atol=1e-5, rtol=0)
    for node, path in enumerate(ancestors(PARENTS), start=1):
        expected = plain_next_logits(model, committed + [TOKENS[n - 1] for n in path])
        torch.testing.assert_close(logits[node], expected, atol=1e-5, rtol=0, msg=f"node {node}")


@pytest.mark.parametrize("path", [[], [1], [2, 6], [1, 4, 7]])
def test_keeping_the_accepted_path_leaves_the_committed_sequences_cache(model, path):
    """After the pass and the gather, the next pass gives what a fresh prefill of the
    committed sequence (prompt, new tokens, accepted path) gives, and the cache is that long."""
    cache = prefilled(model)
    tree_forward(model, cache, NEW, TOKENS, PARENTS)
    committed = PROMPT + NEW
    keep_tree_path(cache, len(committed), path)
    sequence = committed + [TOKENS[node - 1] for node in path]
    assert cache.get_seq_length() == len(sequence)
    next_token = 17
    with torch.inference_mode():
        continued = model(torch.tensor([[next_token]]), past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(continued, plain_next_logits(model, sequence + [next_token]), atol=1e-5, rtol=0)


def test_a_tree_needs_its_root_token(model):
    with pytest.raises(ValueError, match="root"):
        tree_forward(model, prefilled(model), [], TOKENS, PARENTS)


def test_the_row_wise_attention_is_refused(model):
    """specdec.attention's row-wise kernel is causal by construction and would let a node see
    its siblings; a tree pass must not run on it."""
    model.set_attn_implementation(attention.NAME)
    try:
        with pytest.raises(ValueError, match="4D mask"):
            tree_forward(model, prefilled(model), NEW, TOKENS, PARENTS)
    finally:
        model.set_attn_implementation("sdpa")
