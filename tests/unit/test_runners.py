"""Draft and target runners on tiny models: KV reuse, rollback, and exact scoring."""

from __future__ import annotations

import pytest
import torch

from draft_service.drafter import ProposeCall
from draft_service.runner import DraftRunner
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from specdec.sampling.probs import SamplingParams, logits_to_probs
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def draft_runner(tiny_pair) -> DraftRunner:
    return DraftRunner(
        load_causal_lm(str(tiny_pair.draft), "float32", "cpu"),
        max_sessions=4,
        session_ttl_s=60,
        max_speculative_tokens=8,
        proposal_top_k=0,
    )


def full_logits(runner, tokens: list[int]) -> torch.Tensor:
    """Reference: the model run from scratch without any cache. [N, V]"""
    with torch.inference_mode():
        return runner.model(torch.tensor([tokens])).logits[0].float()


def test_rollback_leaves_exactly_the_kept_prefix(target_runner):
    prompt = list(range(5, 25))
    first = target_runner.verify_one(
        VerifyCall("s-rollback", 0, prompt, [30, 31, 32], torch.zeros(3, target_runner.loaded.vocab_size), GREEDY, 0)
    )
    assert first.sequence_length == 23
    session = target_runner.sessions.open("s-rollback", 1)
    assert session.cached_tokens == 23
    # Keep the prompt plus one draft token, then append a different token.
    second = target_runner.verify_one(
        VerifyCall("s-rollback", 21, [40], [], torch.zeros(0, target_runner.loaded.vocab_size), GREEDY, 0, True)
    )
    assert session.tokens == prompt + [30, 40]
    assert session.cached_tokens == 22
    assert second.processed_tokens == 1, "only the new token may run; the prefix must come from the cache"
    reference = logits_to_probs(full_logits(target_runner, prompt + [30, 40])[-1:], GREEDY)
    torch.testing.assert_close(second.target_probs, reference)
    target_runner.end_session("s-rollback")


def test_verify_greedy_matches_argmax_of_uncached_forward(target_runner):
    prompt = [3, 14, 15, 92, 65, 35]
    drafts = [89, 79, 32]
    result = target_runner.verify_one(
        VerifyCall("s-greedy", 0, prompt, drafts, torch.zeros(3, target_runner.loaded.vocab_size), GREEDY, 0)
    )
    argmax = full_logits(target_runner, prompt + drafts)[-4:].argmax(-1).tolist()  # [K + 1]
    assert result.recovered_token_ids == argmax[:3]
    assert result.bonus_token_id == argmax[3]
    assert result.draft_token_target_probs == [float(d == a) for d, a in zip(drafts, argmax)]
    assert result.processed_tokens == len(prompt) + len(drafts)
    target_runner.end_session("s-greedy")


def test_draft_proposals_reuse_cache_across_rounds(draft_runner):
    prompt = list(range(40, 60))
    first = draft_runner.propose_one(ProposeCall("s-draft", 0, prompt, 4, GREEDY, 0))
    assert first.processed_tokens == len(prompt) + 3  # the 4th proposal is not run yet
    assert first.deterministic and first.probs.shape == (4, draft_runner.loaded.vocab_size)
    # Greedy proposals equal the uncached argmax chain.
    chain = list(prompt)
    for _ in range(4):
        chain.append(int(full_logits(draft_runner, chain)[-1].argmax()))
    assert first.token_ids == chain[len(prompt) :]
    # Two accepted, then a recovered token: only that token (and nothing of the prefix) runs.
    second = draft_runner.propose_one(ProposeCall("s-draft", len(prompt) + 2, [7], 2, GREEDY, 0))
    assert second.processed_tokens == 1 + 1
    # All accepted: the uncached 4th proposal and the bonus token run, nothing else.
    third = draft_runner.propose_one(ProposeCall("s-draft", len(prompt) + 2 + 1 + 2, [9], 3, GREEDY, 0))
    assert third.processed_tokens == 2 + 2
    draft_runner.end_session("s-draft")


def test_sampled_proposals_carry_their_distribution(draft_runner):
    params = SamplingParams(temperature=0.8, top_k=10)
    proposal = draft_runner.propose_one(ProposeCall("s-sample", 0, [1, 2, 3], 3, params, seed=11))
    assert not proposal.deterministic
    for token, row in zip(proposal.token_ids, proposal.probs):
        assert row[token] > 0
        assert int((row > 0).sum()) <= 10
        torch.testing.assert_close(row.sum(), torch.tensor(1.0))
    again = draft_runner.propose_one(ProposeCall("s-sample-2", 0, [1, 2, 3], 3, params, seed=11))
    assert again.token_ids == proposal.token_ids, "same seed must give the same proposals"
    draft_runner.end_session("s-sample")
    draft_runner.end_session("s-sample-2")


def test_unknown_session_with_kept_tokens_is_not_found(target_runner):
    with pytest.raises(SessionNotFound, match="keep_tokens=0"):
        target_runner.verify_one(
            VerifyCall("nobody", 5, [1], [], torch.zeros(0, target_runner.loaded.vocab_size), GREEDY, 0)
        )


def test_keep_beyond_sequence_is_invalid(draft_runner):
    draft_runner.propose_one(ProposeCall("s-keep", 0, [1, 2], 1, GREEDY, 0))
    with pytest.raises(InvalidArgument, match=r"outside the session's sequence of 3 tokens"):
        draft_runner.propose_one(ProposeCall("s-keep", 9, [1], 1, GREEDY, 0))
    draft_runner.end_session("s-keep")


def test_out_of_vocab_and_too_long_inputs_are_invalid(target_runner):
    vocab = target_runner.loaded.vocab_size
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        target_runner.verify_one(VerifyCall("s-bad", 0, [vocab], [], torch.zeros(0, vocab), GREEDY, 0))
    with pytest.raises(InvalidArgument, match="context is 256"):
        target_runner.verify_one(VerifyCall("s-bad", 0, [1] * 257, [], torch.zeros(0, vocab), GREEDY, 0))


def test_session_cap_gives_resource_exhausted(tiny_pair):
    runner = TargetRunner(
        load_causal_lm(str(tiny_pair.target), "float32", "cpu"),
        max_sessions=1,
        session_ttl_s=60,
        max_speculative_tokens=4,
    )
    runner.verify_one(VerifyCall("a", 0, [1, 2], [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0))
    with pytest.raises(ResourceExhausted, match="maximum is 1"):
        runner.verify_one(VerifyCall("b", 0, [1, 2], [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0))
    assert runner.end_session("a") and not runner.end_session("a")
    runner.verify_one(VerifyCall("b", 0, [1, 2], [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0))


def test_idle_sessions_expire(tiny_pair):
    runner = TargetRunner(
        load_causal_lm(str(tiny_pair.target), "float32", "cpu"),
        max_sessions=4,
        session_ttl_s=0.0,
        max_speculative_tokens=4,
    )
    runner.verify_one(VerifyCall("idle", 0, [1, 2], [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0))
    assert runner.expire_sessions() == 1
    assert runner.describe().open_sessions == 0


def test_greedy_fast_path_equals_generic_one_hot_path(target_runner):
    """Greedy verify skips building one-hot distributions; asking for the distributions forces
    the generic path, and both must agree for every kind of draft distribution."""
    vocab = target_runner.loaded.vocab_size
    prompt, drafts = [5, 6, 7, 8, 9], [10, 11, 12]
    for draft_probs in (
        torch.zeros(3, vocab).scatter_(1, torch.tensor([[10], [11], [12]]), 1.0),
        torch.full((3, vocab), 1.0 / vocab),
    ):
        fast = target_runner.verify_one(VerifyCall("fast", 0, prompt, drafts, draft_probs, GREEDY, 1))
        generic = target_runner.verify_one(VerifyCall("generic", 0, prompt, drafts, draft_probs, GREEDY, 2, True))
        assert fast.recovered_token_ids == generic.recovered_token_ids
        assert fast.bonus_token_id == generic.bonus_token_id
        assert fast.draft_token_target_probs == generic.draft_token_target_probs
        target_runner.end_session("fast")
        target_runner.end_session("generic")
