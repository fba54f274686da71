"""A call a model service refuses leaves its session as it was, and a call it accepts is
answered, whatever a caller other than the coordinator sends (found by a review: the
coordinator sends neither of these)."""

from __future__ import annotations

import pytest
import torch

from draft_service.drafter import ProposeCall
from draft_service.runner import DraftRunner
from specdec.engine.modeling import load_causal_lm, restrict_output_head
from specdec.errors import InvalidArgument
from specdec.rpc import wire
from specdec.sampling.probs import MIN_TEMPERATURE, SamplingParams
from specdec.v1 import common_pb2
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()


def test_an_empty_propose_on_a_live_draft_session_is_refused_and_leaves_it(tiny_pair):
    """keep_tokens 0 and no new tokens ended the live session of that id (its next call then
    re-prefilled everything)."""
    loaded = load_causal_lm(str(tiny_pair.draft), "float32", "cpu")
    runner = DraftRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=8)
    runner.propose_one(ProposeCall("s", 0, [1, 2, 3, 4], 3, GREEDY, 0, epoch=1))
    session = runner.sessions.peek("s")
    assert session is not None
    held = (list(session.tokens), session.cached_tokens, session.epoch)
    with pytest.raises(InvalidArgument, match="sequence is empty"):
        runner.propose_one(ProposeCall("s", 0, [], 3, GREEDY, 0, epoch=2))
    assert runner.sessions.peek("s") is session and (list(session.tokens), session.cached_tokens, session.epoch) == held
    assert runner.propose_one(ProposeCall("s", 7, [5], 3, GREEDY, 0, epoch=3)).token_ids


def test_a_chain_verify_after_a_tree_whose_drafts_are_cached_nodes_is_answered(tiny_pair):
    """A chain's drafts that spell cached tree nodes were taken from the tree: the pass then
    scored fewer than K + 1 rows and the call failed INTERNAL (IndexError), its session
    advanced. Only the tokens before the scored ones come from the tree now."""
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    runner = TargetRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=8)
    runner.trees = True

    def call(session: str, keep: int, new: list[int], drafts: list[int], parents: tuple[int, ...] = ()) -> VerifyCall:
        rows = torch.zeros(len(drafts), loaded.vocab_size)
        return VerifyCall(session, keep, new, drafts, rows, GREEDY, 0, parents=parents)

    runner.verify_one(call("s", 0, [1, 2, 3], [4, 5], (0, 1)))
    chained = runner.verify_one(call("s", 3, [4], [5, 6]))  # 4 and 5: the tree's cached path
    fresh = runner.verify_one(call("t", 0, [1, 2, 3, 4], [5, 6]))
    assert chained.sequence_length == fresh.sequence_length == 6
    assert (chained.recovered_token_ids, chained.bonus_token_id) == (fresh.recovered_token_ids, fresh.bonus_token_id)


def test_a_services_sampling_refuses_a_temperature_that_overflows_the_logits():
    """The coordinator refuses a temperature below MIN_TEMPERATURE; a caller of the draft or
    target service directly was not: at 1e-40 logits / temperature overflowed, the draft's rows
    were NaN and it answered OK with them (the target then refused them as the caller's error)."""
    with pytest.raises(InvalidArgument, match="temperature"):
        wire.params_from_pb(common_pb2.SamplingParams(temperature=1e-40, top_p=1.0))
    for temperature in (0.0, MIN_TEMPERATURE, 0.7):
        params = wire.params_from_pb(common_pb2.SamplingParams(temperature=temperature, top_p=1.0))
        assert params.temperature == pytest.approx(temperature)


def test_a_vocab_limit_below_every_row_of_a_cut_head_is_refused_before_the_session_opens(tiny_pair):
    """A draft whose output head is cut to some ids (a bridge, --draft-vocab) refused a
    vocab_limit below all of them only at its first draw, after opening the session and
    prefilling its prompt, which then stayed until its TTL."""
    loaded = load_causal_lm(str(tiny_pair.draft), "float32", "cpu")
    head_ids = torch.arange(10, loaded.vocab_size)  # the head's rows stand for ids 10 and up
    restrict_output_head(loaded.model, head_ids)
    runner = DraftRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=8, head_ids=head_ids)
    with pytest.raises(InvalidArgument, match="no token to propose"):
        runner.propose_one(ProposeCall("s", 0, [11, 12, 13], 3, GREEDY, 0, vocab_limit=10))
    assert runner.sessions.ids() == [] and runner.processed_tokens_total == 0
    assert set(runner.propose_one(ProposeCall("s", 0, [11, 12, 13], 3, GREEDY, 0, vocab_limit=12)).token_ids) <= {
        10,
        11,
    }
