"""Token-level intersection (draft_service.vocab_bridge): the id maps between a target's
tokenizer and a draft's own, and the bridged draft runner that speaks the target's ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from coordinator.clients import check_pair
from coordinator.metrics import CoordinatorMetrics, GenerationStats
from coordinator.state import MalformedReply, round_from
from draft_service import server as draft_server
from draft_service.drafter import ProposeCall
from draft_service.vocab_bridge import VocabBridge, vocabulary_keys
from specdec.engine.modeling import load_tokenizer_info, tokenizer_fingerprint
from specdec.engine.tokens import bytes_to_unicode
from specdec.errors import InvalidArgument
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.tools.testing import CORPUS, DRAFT_CORPUS, EOS, byte_level_tokenizer
from specdec.v1 import common_pb2, draft_pb2
from tests.stack import model_service_config

TEXTS = [*CORPUS[:6], *DRAFT_CORPUS[:4], "    indented   spaces\n\n\ttabs", "ünïcödé 東京 🙂🙂 mixed"]


def side(tokenizer, vocab_size: int | None = None):
    """What VocabBridge reads of a LoadedModel or TokenizerInfo."""
    return SimpleNamespace(
        tokenizer=tokenizer,
        vocab_size=vocab_size or len(tokenizer),
        model_id="tiny",
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        eos_token_ids=(tokenizer.eos_token_id,),
    )


@pytest.fixture(scope="module")
def tokenizers():
    return byte_level_tokenizer(), byte_level_tokenizer(300, DRAFT_CORPUS, ("<pad>", EOS))


def test_shared_tokens_are_the_same_bytes_and_specials_pair_only_with_specials(tokenizers):
    target, draft = tokenizers
    bridge = VocabBridge(side(draft), side(target, len(target) + 5))
    target_keys = {i: key for key, i in vocabulary_keys(target).items()}
    draft_keys = {i: key for key, i in vocabulary_keys(draft).items()}
    assert 0 < len(bridge.draft_ids) < len(target)
    for draft_id, target_id in zip(bridge.draft_ids.tolist(), bridge.caller_ids.tolist(), strict=True):
        assert draft_keys[draft_id] == target_keys[target_id]
        assert bridge.to_caller(draft_id) == target_id and bridge.draft_form(target_id) == (draft_id,)
    eos = target.convert_tokens_to_ids(EOS)
    assert bridge.draft_form(eos) == (draft.convert_tokens_to_ids(EOS),)  # ids differ: <pad> comes first
    assert draft.convert_tokens_to_ids(EOS) != eos
    # Figures: the share of the target's tokenizer, and one bit per proposable id.
    assert bridge.figures.shared_tokens == len(bridge.draft_ids)
    assert bridge.figures.caller_vocab_tokens == len(target)
    bits = [bool(bridge.figures.proposable[i >> 3] >> (i & 7) & 1) for i in range(len(target) + 5)]
    assert [i for i, bit in enumerate(bits) if bit] == sorted(bridge.caller_ids.tolist())


def test_any_target_sequence_reads_as_the_same_text_in_the_drafts_tokens(tokenizers):
    """Tokens outside the intersection are spelled by the draft's own merges, token by token:
    the draft reads the same bytes, and positions only grow."""
    target, draft = tokenizers
    bridge = VocabBridge(side(draft), side(target))
    spelled = 0
    for text in TEXTS:
        ids = target.encode(text)
        draft_ids, positions = bridge.to_draft(ids, start=7)
        assert draft.decode(draft_ids) == text
        assert positions[-1] == 7 + len(draft_ids) and all(b > a for a, b in zip([7, *positions], positions))
        spelled += sum(len(bridge.draft_form(i)) > 1 for i in ids)
    assert spelled > 0, "no token needed spelling; the test exercises only shared tokens"


def test_ids_without_text_read_as_one_fallback_token_and_ids_past_the_vocabulary_are_refused(tokenizers):
    target, draft = tokenizers
    bridge = VocabBridge(side(draft), side(target, len(target) + 3))
    assert len(bridge.draft_form(len(target) + 1)) == 1  # a logit column past the tokenizer
    with pytest.raises(InvalidArgument, match=r"new_tokens\[1\] = 999 is outside the target's vocabulary"):
        bridge.to_draft([1, 999], 0)


def test_byte_level_alphabet_is_gpt2s():
    alphabet = bytes_to_unicode()
    assert len(set(alphabet.values())) == 256 and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"


@pytest.fixture(scope="module")
def runner(bridged_pair):
    config = model_service_config(
        draft_server.DraftConfig, bridged_pair.draft, quantize="none", target_tokenizer=str(bridged_pair.target)
    )
    return draft_server.load_runner(config)


def call(session: str, keep: int, new: list[int], k: int = 4, **fields) -> ProposeCall:
    return ProposeCall(session, keep, new, k, fields.pop("params", SamplingParams()), fields.pop("seed", 1), **fields)


def test_bridged_draft_describes_itself_in_the_targets_ids(runner, bridged_pair):
    target = load_tokenizer_info(str(bridged_pair.target))
    info = wire.description_to_pb(runner.describe())
    assert info.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert info.vocab_size == target.vocab_size and list(info.eos_token_ids) == list(target.eos_token_ids)
    assert info.vocab_bridge.shared_tokens == len(runner.bridge.draft_ids)
    assert info.vocab_bridge.draft_tokenizer_fingerprint == runner.loaded.tokenizer_fingerprint


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_proposals_are_shared_target_ids_with_distributions_over_the_targets_vocabulary(runner, params):
    tokenizer = runner.bridge.caller.tokenizer
    prompt = tokenizer.encode(TEXTS[-2])
    proposal = runner.propose_one(call(f"p-{params.temperature}", 0, prompt, 5, params=params))
    shared = set(runner.bridge.caller_ids.tolist())
    assert proposal.token_ids and set(proposal.token_ids) <= shared
    assert set(proposal.runner_up_ids) <= shared
    assert proposal.sequence_length == len(prompt) + len(proposal.token_ids)
    if not proposal.deterministic:
        assert proposal.probs.shape == (len(proposal.token_ids), runner.bridge.caller_vocab_size)
        assert torch.allclose(proposal.probs.sum(dim=-1), torch.ones(len(proposal.token_ids)))
        outside = torch.ones(runner.bridge.caller_vocab_size, dtype=torch.bool)
        outside[runner.bridge.caller_ids] = False
        assert float(proposal.probs[:, outside].sum()) == 0.0
        for row, token in enumerate(proposal.token_ids):
            assert proposal.probs[row, token] > 0


def test_a_session_continued_by_keep_tokens_proposes_as_a_fresh_one(runner):
    """Rollback in the target's count: keep one proposal, add a token the draft has to spell,
    and the next proposal equals that of a fresh session sent the whole sequence; a fork too."""
    tokenizer = runner.bridge.caller.tokenizer
    prompt = tokenizer.encode(TEXTS[0])
    first = runner.propose_one(call("s", 0, prompt, 3))
    spelled = next(i for i in tokenizer.encode(TEXTS[-1]) if len(runner.bridge.draft_form(i)) > 1)
    kept = len(prompt) + 1
    sequence = [*prompt, first.token_ids[0], spelled]
    second = runner.propose_one(call("s", kept, [spelled], 3))
    fresh = runner.propose_one(call("fresh", 0, sequence, 3))
    fork = runner.propose_one(call("fork", kept, [spelled], 3, fork_from="fresh", epoch=0))
    assert second.token_ids == fresh.token_ids == fork.token_ids
    assert second.sequence_length == len(sequence) + 3
    with pytest.raises(InvalidArgument, match="keep_tokens=99 is outside the session's sequence of"):
        runner.propose_one(call("s", 99, [1], 3))


def test_a_tree_and_a_copy_speak_the_targets_ids(bridged_pair):
    config = model_service_config(
        draft_server.DraftConfig,
        bridged_pair.draft,
        quantize="none",
        drafter="hybrid",
        ngram_min=1,
        target_tokenizer=str(bridged_pair.target),
    )
    hybrid = draft_server.load_runner(config)
    tokenizer = hybrid.bridge.caller.tokenizer
    shared = set(hybrid.bridge.caller_ids.tolist())
    tree = hybrid.propose_one(call("t", 0, tokenizer.encode(TEXTS[1]), 0, tree_widths=(2, 2), max_copied_tokens=0))
    assert len(tree.token_ids) == 6 and set(tree.token_ids) <= shared
    repeated = tokenizer.encode("x = x + 1\nx = x + 1\nx = x + 1\nx = x")
    copy = hybrid.propose_one(call("c", 0, repeated, 4))
    assert copy.copied and copy.token_ids and set(copy.token_ids) <= shared
    assert copy.sequence_length == len(repeated) + len(copy.token_ids)


def test_coordinator_refuses_a_pair_below_the_minimum_overlap_naming_it():
    target = common_pb2.ModelInfo(model_id="t", tokenizer_fingerprint="abc")
    draft = common_pb2.ModelInfo(
        model_id="d",
        tokenizer_fingerprint="abc",
        vocab_bridge=common_pb2.VocabBridgeInfo(draft_model_id="small", shared_tokens=50, target_vocab_tokens=1000),
    )
    check_pair(draft, target, "abc", "d:1", "t:1", min_vocab_overlap=0.05)
    with pytest.raises(InvalidArgument, match=r"shares 50 tokens .* 5\.0% of its 1000; the coordinator asks"):
        check_pair(draft, target, "abc", "d:1", "t:1", min_vocab_overlap=0.1)
    unbridged = common_pb2.ModelInfo(model_id="d", tokenizer_fingerprint="xyz")
    with pytest.raises(InvalidArgument, match="--target-tokenizer"):
        check_pair(unbridged, target, "abc", "d:1", "t:1")


def test_a_proposal_outside_the_shared_ids_is_verified_and_counted_and_an_invalid_id_fails():
    """A target id the bridged draft does not share is a draft like any other (verified with
    its own distribution), marked so the coordinator counts it; an id outside the target's
    vocabulary, or one without mass under its distribution, fails the reply."""
    proposable = bytes([0b0000_0101])  # ids 0 and 2
    one_hot = common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())
    ok = draft_pb2.ProposeResponse(token_ids=[2, 0], distributions=[one_hot, one_hot])
    shared = round_from(ok, 2, "d:1", 8, proposable=proposable)
    assert shared.draft_token_ids == [2, 0] and shared.foreign == ()
    foreign = draft_pb2.ProposeResponse(token_ids=[2, 1, 1], distributions=[one_hot] * 3)
    drafts = round_from(foreign, 3, "d:1", 8, proposable=proposable)
    assert drafts.draft_token_ids == [2, 1, 1] and drafts.foreign == (1, 2)
    assert drafts.truncated(2, start=1).foreign == (0, 1) and drafts.truncated(1).foreign == ()
    outside = draft_pb2.ProposeResponse(token_ids=[2, 8], distributions=[one_hot, one_hot])
    with pytest.raises(
        MalformedReply, match=r"proposed token 8 at position 1, outside the target's vocabulary \[0, 8\)"
    ):
        round_from(outside, 2, "d:1", 8, proposable=proposable)
    sparse = common_pb2.ProposalDistribution(sparse=common_pb2.SparseProbs(token_ids=[3], probs=[1.0]))
    massless = draft_pb2.ProposeResponse(token_ids=[1], distributions=[sparse])
    with pytest.raises(MalformedReply, match="proposed token 1 at position 0 with probability 0.0"):
        round_from(massless, 1, "d:1", 8, proposable=proposable)


def test_a_target_tokenizer_that_cannot_be_read_stops_the_draft_at_start_up(bridged_pair, tmp_path):
    config = model_service_config(
        draft_server.DraftConfig, bridged_pair.draft, quantize="none", target_tokenizer=str(tmp_path / "missing")
    )
    with pytest.raises(ValueError, match="--target-tokenizer .*missing: the tokenizer cannot be read"):
        draft_server.load_runner(config)


def test_foreign_drafts_and_malformed_replies_are_counted():
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.observe_finished(GenerationStats(proposed_tokens=5, foreign_tokens=3), "length")
    metrics.observe_failed("INTERNAL", malformed=True)
    metrics.observe_failed("UNAVAILABLE")
    assert registry.get_sample_value("specdec_draft_foreign_tokens_total") == 3
    assert registry.get_sample_value("specdec_malformed_replies_total") == 1
