"""Tree speculation through real gRPC services (issue 19): greedy output is the target's own
with a float32 and an int8 target, and after every round both services hold exactly the
committed sequence's KV cache, as a fresh prefill would build it. Sampled trees' χ² cases
are in test_distribution.py; the acceptance rule's own power checks in
tests/heavy/test_tree_sampling.py."""

from __future__ import annotations

import copy

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from transformers import DynamicCache

from coordinator import acceptance
from draft_service import server as draft_server
from draft_service.config import DraftConfig
from draft_service.drafter import ProposeCall
from specdec.engine import sessions
from specdec.engine.costs import PassCosts
from specdec.engine.modeling import with_cache
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.sampling.tree_sampling import TreeOutcome, decide_tree
from specdec.v1 import coordinator_pb2 as pb
from target_service import server as target_server
from target_service.config import TargetConfig
from target_service.runner import VerifyCall
from tests.stack import inprocess_stack, local_stack, model_service_config

PROMPTS = ["def add(a, b):", "The quick brown fox", "x = x + 1\nx = x + 1\nx"]
SHAPES = [(2, 2), (3, 1, 1), (1, 1, 1, 1), (2, 2, 2)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    async with inprocess_stack(tiny_pair, draft_overrides={"quantize": "none"}) as running:
        yield running


async def test_greedy_trees_give_the_targets_output(stack, reference):
    for prompt in PROMPTS:
        for shape in SHAPES:
            response = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=30, tree_widths=shape), timeout=60
            )
            assert list(response.token_ids) == reference(prompt, 30), f"tree {shape} diverged on {prompt!r}"
            s = response.stats
            assert s.generated_tokens == s.accepted_tokens + s.recovered_tokens + s.bonus_tokens
            assert s.accepted_tokens > 0 and s.proposed_tokens > 0


async def test_tree_requests_are_checked(stack):
    bad = [
        ({"tree_widths": [2, 0]}, "width"),
        ({"tree_widths": [4, 4, 4]}, "nodes"),
        ({"tree_widths": [2], "num_speculative_tokens": 2}, "replaces"),
        ({"tree_widths": [2], "draft_min_confidence": 0.5}, "replaces"),
    ]
    for fields, message in bad:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=4, **fields), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert message in caught.value.details(), caught.value.details()


async def test_a_greedy_tree_wider_than_the_drafts_vocabulary_proposes_what_it_has(word_pair):
    """A level wider than the draft's vocabulary (12 words) takes every token it has, as a
    sampled one draws that many; topk over more ids than the row holds failed the request
    (INTERNAL)."""
    async with local_stack(word_pair, draft_overrides={"quantize": "none"}) as stack:
        request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=12)
        expected = await stack.stub.Generate(
            pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=12, num_speculative_tokens=0), timeout=60
        )
        for widths in ([13], [13, 1]):
            request.tree_widths[:] = widths
            response = await stack.stub.Generate(request, timeout=60)
            assert list(response.token_ids) == list(expected.token_ids), widths
            assert response.stats.proposed_tokens > 0


async def test_an_int8_target_gives_its_own_greedy_output_with_trees(tiny_pair):
    """The CPU target setting (int8 layers, row-wise attention): a tree pass scores every node
    bitwise as one-token decoding would, so trees give exactly the int8 target's K = 0 output."""
    async with inprocess_stack(tiny_pair, target_overrides={"quantize": "int8"}) as int8_stack:
        for prompt in PROMPTS:
            alone = await int8_stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=30, num_speculative_tokens=0), timeout=60
            )
            for shape in SHAPES[:2]:
                response = await int8_stack.stub.Generate(
                    pb.GenerateRequest(prompt=prompt, max_new_tokens=30, tree_widths=shape), timeout=60
                )
                assert list(response.token_ids) == list(alone.token_ids), f"tree {shape} diverged on {prompt!r}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_after_every_round_both_caches_are_the_committed_sequences(tiny_pair, temperature):
    """Tree rounds driven by hand through both runners: after each, the call that follows
    keeps the accepted branch from the cached nodes (none of it runs again) and both caches
    then equal a fresh prefill of the committed sequence."""
    draft = draft_server.load_runner(model_service_config(DraftConfig, tiny_pair.draft, quantize="none"))
    target = target_server.load_runner(model_service_config(TargetConfig, tiny_pair.target))
    params = SamplingParams(temperature=temperature)
    coins = np.random.default_rng(0)
    sequence, synced, reused = [3, 7, 11, 5, 2, 9], 0, 0
    for round_index in range(8):
        new = sequence[synced:]
        proposal = draft.propose_one(ProposeCall("s", synced, new, 0, params, round_index, tree_widths=(2, 2)))
        probs = (
            torch.zeros(0)
            if proposal.deterministic and temperature == 0
            else wire.decode_distributions(
                wire.encode_distributions(proposal.probs, len(proposal.token_ids), proposal.deterministic),
                proposal.token_ids,
                target.loaded.vocab_size,
            )
        )
        verified = target.verify_one(
            VerifyCall(
                "s", synced, new, proposal.token_ids, probs, params, round_index, parents=tuple(proposal.parents)
            )
        )
        draft_probs = [1.0] * len(proposal.token_ids)
        if not proposal.deterministic:
            draft_probs = [float(proposal.probs[i, t]) for i, t in enumerate(proposal.token_ids)]
        outcome = decide_tree(
            verified.draft_token_target_probs,
            draft_probs,
            coins.random(len(proposal.token_ids)).tolist(),
            proposal.parents,
            verified.recovered_token_ids,
        )
        synced = len(sequence)
        sequence += outcome.committed(proposal.token_ids)
        reused += outcome.num_accepted
        # The target caches every node; the draft every level but the last (leaves never ran).
        for runner, cached_depth in ((draft, 1), (target, 2)):
            session = copy.deepcopy(runner.sessions.open("s", synced))
            pending = session.extend(synced, sequence[synced:])
            assert session.tokens == sequence
            # The accepted nodes the runner cached are kept: only what follows them runs.
            assert 1 <= len(pending) <= len(sequence) - synced - min(outcome.num_accepted, cached_depth)
            assert_cache_is_a_fresh_prefill(runner, session.cache, sequence[: session.cached_tokens])
    assert reused > 0, "no round accepted a node, so no branch was kept"


def assert_cache_is_a_fresh_prefill(runner, cache, tokens: list[int]) -> None:
    fresh = DynamicCache(config=runner.model.config)
    with torch.inference_mode():
        runner.model(torch.tensor([tokens]), **with_cache(runner.model, fresh))
    assert cache.get_seq_length() == len(tokens)
    for kept, expected in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(kept.keys, expected.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(kept.values, expected.values, atol=1e-4, rtol=0)


async def test_a_drafter_without_a_model_refuses_trees_clearly(tiny_pair):
    async with inprocess_stack(tiny_pair, draft_overrides={"drafter": "ngram"}) as ngram_stack:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ngram_stack.stub.Generate(
                pb.GenerateRequest(prompt="a b a b", max_new_tokens=4, tree_widths=[2]), timeout=30
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not serve token trees" in caught.value.details()
        # ... and it keeps serving chains.
        response = await ngram_stack.stub.Generate(pb.GenerateRequest(prompt="a b a b", max_new_tokens=4), timeout=30)
        assert len(response.token_ids) == 4


async def test_the_tree_chooser_uses_trees_where_they_pay_and_keeps_greedy_exact(tiny_pair, reference):
    """--tree-chooser with costs where verify rows are nearly free (a GPU's shape): requests
    that leave K unset get trees, and greedy output stays the target's."""

    def flat_costs(draft_runner, target_runner) -> None:
        draft_runner.pass_costs = PassCosts((2.0,) * 9, context_tokens=128)
        target_runner.pass_costs = PassCosts((10.0,) * 9, context_tokens=128)

    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        coordinator_overrides={"tree_chooser": True, "live_costs": False},  # the costs set here, not the tiny pair's
        prepare_runners=flat_costs,
    ) as chooser_stack:
        trees = speculative = 0
        for prompt in PROMPTS:
            response = await chooser_stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=30), timeout=60
            )
            assert list(response.token_ids) == reference(prompt, 30), prompt
            trees += response.stats.tree_rounds
            speculative += sum(1 for k in response.stats.k_per_round if k)
        # Where the chooser speculates at all (this tiny draft is often poor: K = 0), it uses trees.
        assert trees > speculative // 2 and trees > 0, (trees, speculative)


async def test_power_greedy_identity_fails_when_the_walk_ignores_the_outcome(stack, reference, monkeypatch):
    """Power check: a coordinator that, once a root child is accepted, takes the first child
    instead (the branch picked by its index, not by the verification) diverges from the
    target's greedy output on these prompts."""
    plain = acceptance.decide_tree

    def first_child(node_target_probs, node_draft_probs, uniforms, parents, next_token_ids):
        outcome = plain(node_target_probs, node_draft_probs, uniforms, parents, next_token_ids)
        if outcome.path and outcome.path[0] != 1:
            return TreeOutcome([1], int(next_token_ids[1]), at_leaf=False)
        return outcome

    monkeypatch.setattr(acceptance, "decide_tree", first_child)
    diverged = 0
    for prompt in PROMPTS:
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=30, tree_widths=[3, 1]), timeout=60
        )
        diverged += list(response.token_ids) != reference(prompt, 30)
    assert diverged, "the identity test cannot tell a branch picked by index from the verified one"


def test_power_the_cache_check_fails_when_a_sibling_is_kept(tiny_pair, monkeypatch):
    """Power check: a session that keeps each path node's next sibling (a gather of the wrong
    entries) fails the fresh-prefill comparison."""
    plain = sessions.keep_tree_path

    def sibling(cache, committed, path):
        plain(cache, committed, [node + 1 if node % 2 else node for node in path])

    monkeypatch.setattr(sessions, "keep_tree_path", sibling)
    with pytest.raises(AssertionError):
        test_after_every_round_both_caches_are_the_committed_sequences(tiny_pair, 0.0)
