"""One pass over a token tree scores every branch as a plain forward would, and keeping the
accepted path leaves the cache of the committed sequence (specdec.engine.tree_pass)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specdec.engine import attention
from specdec.engine.modeling import with_cache
from specdec.engine.quantize import quantize_int8
from specdec.engine.sessions import KVSession
from specdec.engine.tree_pass import CachedTree, keep_tree_path, tree_forward
from specdec.sampling.tree_sampling import ancestors

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
        model(torch.tensor([PROMPT]), **with_cache(model, cache))
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
        continued = model(torch.tensor([[next_token]]), **with_cache(model, cache)).logits[0, -1]
    torch.testing.assert_close(continued, plain_next_logits(model, sequence + [next_token]), atol=1e-5, rtol=0)


def test_a_tree_needs_its_root_token(model):
    with pytest.raises(ValueError, match="root"):
        tree_forward(model, DynamicCache(config=model.config), [], TOKENS, PARENTS)


def test_a_tree_grown_a_level_per_pass_scores_as_one_pass(model):
    """The draft's way: the root's pass, then each level on top of the cached levels above."""
    whole = tree_forward(model, prefilled(model), NEW, TOKENS, PARENTS)
    cache = prefilled(model)
    rows = [tree_forward(model, cache, NEW, TOKENS[:2], PARENTS[:2])]  # root + nodes 1, 2
    rows.append(tree_forward(model, cache, [], TOKENS[:6], PARENTS[:6], first_node=3))  # nodes 3..6
    rows.append(tree_forward(model, cache, [], TOKENS, PARENTS, first_node=7))  # node 7
    torch.testing.assert_close(torch.cat(rows), whole, atol=1e-5, rtol=0)
    assert cache.get_seq_length() == len(PROMPT + NEW) + len(TOKENS)


def test_the_row_wise_int8_pass_is_bitwise_one_token_decoding(model):
    """The target's setting on CPU (int8 layers, specdec.engine.attention): every node's logits are
    bitwise those of decoding its path one token at a time, so greedy trees stay identical
    to the target's own greedy output."""
    quantised = copy.deepcopy(model)
    quantize_int8(quantised)
    quantised.set_attn_implementation(attention.NAME)
    logits = tree_forward(quantised, prefilled(quantised), NEW, TOKENS, PARENTS)
    for node, path in enumerate(ancestors(PARENTS), start=1):
        cache = prefilled(quantised)
        with torch.inference_mode():
            for token in NEW + [TOKENS[n - 1] for n in path]:
                decoded = quantised(torch.tensor([[token]]), **with_cache(quantised, cache)).logits[0, -1]
        assert torch.equal(decoded, logits[node]), f"node {node}"


def test_the_longest_verify_the_services_accept_is_attended_row_by_row(model):
    """A verify of the longest copy (--max-speculative-tokens at its default, plus the last
    committed token) stays within the bounded per-row form, so each row is bitwise one-token
    decoding; with MAX_ROWS at 32 a 33-row verify fell back to SDPA."""
    from specdec.config.services import ModelServiceConfig

    rows = ModelServiceConfig.max_speculative_tokens + 1
    assert rows <= attention.MAX_ROWS
    quantised = copy.deepcopy(model)
    quantize_int8(quantised)
    quantised.set_attn_implementation(attention.NAME)
    tokens = [(7 * i) % 50 for i in range(rows)]
    cache = prefilled(quantised)
    with torch.inference_mode():
        logits = quantised(torch.tensor([tokens]), **with_cache(quantised, cache)).logits[0]
    cache = prefilled(quantised)
    with torch.inference_mode():
        for i, token in enumerate(tokens):
            decoded = quantised(torch.tensor([[token]]), **with_cache(quantised, cache)).logits[0, -1]
            assert torch.equal(decoded, logits[i]), f"row {i}"


def test_a_session_keeps_the_branch_its_next_call_spells_and_drops_the_rest(model):
    """KVSession.tree: the next call's new tokens (the accepted path, then the next token)
    reuse the path's cached nodes; a call that rolls back before the tree drops them all."""
    committed = PROMPT + NEW
    for keep, new, reused in (
        (len(committed), [TOKENS[0], TOKENS[3], TOKENS[6], 17], 3),  # path 1 -> 4 -> 7, then 17
        (len(committed), [TOKENS[1], 17], 1),  # path 2, then a token no child of 2 holds
        (len(committed), [17], 0),  # every child of the root rejected
        (len(PROMPT), [9, 9], 0),  # a rollback into the committed tokens
    ):
        session = KVSession("s", tokens=list(committed), cache=prefilled(model))
        tree_forward(model, session.cache, NEW, TOKENS, PARENTS)
        session.tree = CachedTree(len(committed), tuple(TOKENS), tuple(PARENTS), len(TOKENS))
        pending = session.extend(keep, new)
        sequence = committed[:keep] + new
        assert session.tokens == sequence and session.tree is None
        assert pending == new[reused:], (new, pending)
        next_token = 5
        with torch.inference_mode():
            logits = model(torch.tensor([pending + [next_token]]), **with_cache(model, session.cache)).logits[0, -1]
        torch.testing.assert_close(logits, plain_next_logits(model, sequence + [next_token]), atol=1e-5, rtol=0)
