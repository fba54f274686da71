"""The draft service's drafters on tiny models: prompt lookup, int8, reduced-vocabulary head."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from draft_service import server as draft_server
from draft_service.config import DraftConfig
from draft_service.config import parse_config as draft_config
from draft_service.drafter import ProposeCall
from draft_service.ngram import NgramDrafter, lookup
from draft_service.runner import DraftRunner
from specdec.engine.modeling import frequent_token_ids, load_causal_lm, load_tokenizer_info, restrict_output_head
from specdec.engine.quantize import RowwiseInt8Linear
from specdec.errors import InvalidArgument, SessionNotFound
from specdec.sampling.probs import SamplingParams
from tests.stack import model_service_config

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def test_lookup_prefers_the_longest_suffix_then_the_most_recent_occurrence():
    # Suffix [1, 2] occurs at 0 (followed by 3, 4) and at 5 (followed by 9): the latest wins.
    assert lookup(ids(1, 2, 3, 4, 0, 1, 2, 9, 7, 1, 2), 1, 4, 3) == [9, 7, 1]
    # [5, 1, 2] recurs once, earlier than a bare [1, 2]: the longer match wins.
    assert lookup(ids(5, 1, 2, 8, 6, 1, 2, 7, 5, 1, 2), 1, 4, 2) == [8, 6]
    # The continuation stops at the end of the sequence.
    assert lookup(ids(4, 4, 4), 1, 2, 5) == [4]


def test_lookup_respects_min_n_and_finds_nothing_without_a_recurrence():
    assert lookup(ids(1, 2, 3, 4), 1, 4, 3) == []
    assert lookup(ids(1, 2, 3, 9, 3), 2, 4, 3) == [], "a single recurring token is below min_n=2"
    assert lookup(ids(1, 2, 3, 9, 3), 1, 4, 3) == [9, 3]
    assert lookup(ids(7), 1, 4, 3) == []


@pytest.fixture(scope="module")
def ngram(tiny_pair) -> NgramDrafter:
    return NgramDrafter(
        load_tokenizer_info(str(tiny_pair.target)),
        max_sessions=4,
        session_ttl_s=60,
        max_speculative_tokens=8,
        min_n=1,
        max_n=3,
    )


def test_ngram_drafter_keeps_its_sequence_and_rolls_back(ngram, tiny_pair):
    prompt = [10, 11, 12, 13, 10, 11]
    first = ngram.propose_one(ProposeCall("n", 0, prompt, 4, SAMPLED, 0))
    assert first.token_ids == [12, 13, 10, 11] and first.deterministic and first.probs is None
    assert first.processed_tokens == 0 and first.sequence_length == 10
    # The target accepted two of them and recovered 40: keep prompt + 2, send the recovered token.
    second = ngram.propose_one(ProposeCall("n", 8, [40], 4, SAMPLED, 0))
    assert ngram.sessions.open("n", 1).tokens[:9] == prompt + [12, 13, 40]
    assert second.token_ids == [] and second.sequence_length == 9, "40 never occurred before, so nothing is proposed"
    with pytest.raises(SessionNotFound):
        ngram.propose_one(ProposeCall("unknown", 3, [1], 2, GREEDY, 0))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        ngram.propose_one(ProposeCall("n", 9, [tiny_pair.vocab_size], 2, GREEDY, 0))
    info = ngram.describe()
    assert info.vocab_size == tiny_pair.vocab_size and info.model_id.startswith("ngram[1..3]")
    assert info.tokenizer_fingerprint == load_causal_lm(str(tiny_pair.target), "float32", "cpu").tokenizer_fingerprint
    assert ngram.end_session("n") and not ngram.end_session("n")


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()  # [V]


def test_reduced_head_scores_exactly_its_ids_and_proposes_only_them(tiny_pair):
    reference = load_causal_lm(str(tiny_pair.draft), "float32", "cpu")
    loaded = load_causal_lm(str(tiny_pair.draft), "float32", "cpu")
    head_ids = frequent_token_ids(loaded.tokenizer, loaded.vocab_size, 100, loaded.eos_token_ids)
    assert set(head_ids.tolist()) == set(range(100)) | {tiny_pair.eos_token_id}
    assert frequent_token_ids(loaded.tokenizer, loaded.vocab_size, 3, (300,)).tolist() == [0, 1, 2, 300]
    restrict_output_head(loaded.model, head_ids)
    runner = DraftRunner(
        loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=8, proposal_top_k=0, head_ids=head_ids
    )
    prompt = [5, 17, 99, 200, 31]
    # The restricted head's logits are the full head's logits at its ids.
    torch.testing.assert_close(full_logits(loaded.model, prompt), full_logits(reference.model, prompt)[head_ids])
    greedy = runner.propose_one(ProposeCall("g", 0, prompt, 3, GREEDY, 0))
    expected = int(head_ids[full_logits(reference.model, prompt)[head_ids].argmax()])
    assert greedy.token_ids[0] == expected
    sampled = runner.propose_one(ProposeCall("s", 0, prompt, 4, SAMPLED, 0))
    outside = torch.ones(loaded.vocab_size, dtype=torch.bool)
    outside[head_ids] = False
    assert sampled.probs.shape == (4, loaded.vocab_size)
    assert float(sampled.probs[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(4))
    assert all(t in set(head_ids.tolist()) for t in sampled.token_ids)
    for token, row in zip(sampled.token_ids, sampled.probs):
        assert row[token] > 0


def test_int8_draft_is_quantised_reports_it_and_stays_close(tiny_pair):
    config = model_service_config(DraftConfig, tiny_pair.draft)  # quantize="auto" on CPU float32
    assert config.resolved_quantize() == "int8"
    runner = draft_server.load_runner(config)
    assert any(isinstance(m, RowwiseInt8Linear) for m in runner.model.modules())
    assert runner.describe().quantization.startswith("int8")
    reference = load_causal_lm(str(tiny_pair.draft), "float32", "cpu")
    prompt = [5, 17, 99, 200, 31]
    proposal = runner.propose_one(ProposeCall("q", 0, prompt, 2, SAMPLED, 0))
    exact = torch.softmax(full_logits(reference.model, prompt), -1)
    assert float((proposal.probs[0] - exact).abs().sum()) < 0.2, "int8 should move the distribution only a little"
    plain = draft_server.load_runner(dataclasses.replace(config, quantize="none"))
    assert plain.describe().dtype == "float32"


def test_auto_quantisation_and_contradictory_flags():
    base = draft_config(["--model", "m"], {})
    assert base.quantize == "auto" and base.drafter == "model"
    assert dataclasses.replace(base, dtype="bfloat16").resolved_quantize() == "none"
    assert dataclasses.replace(base, device="cuda").resolved_quantize() == "none"
    assert dataclasses.replace(base, quantize="int8", device="cuda").problem() is not None
    assert dataclasses.replace(base, drafter="ngram", quantize="int8").problem() is not None
    assert dataclasses.replace(base, drafter="ngram", ngram_min=3, ngram_max=2).problem() is not None
    for held in ({"max_kv_bytes": 1 << 30}, {"prefix_cache_bytes": 1 << 30}):  # it holds no KV to budget or cache
        assert "the ngram drafter holds no KV" in dataclasses.replace(base, drafter="ngram", **held).problem()
    assert dataclasses.replace(base, drafter="ngram").problem() is None
    assert dataclasses.replace(base, drafter="ngram", max_speculative_tokens=64).problem() is None
    assert "must be in [1, 64]" in dataclasses.replace(base, drafter="ngram", max_speculative_tokens=65).problem()
    with pytest.raises(SystemExit):
        draft_config(["--model", "m", "--quantize", "int8", "--dtype", "bfloat16"], {})
    assert dataclasses.replace(base, drafter="hybrid", ngram_min=0).problem() == "ngram_min must be in [1, 4]; got 0"
    for gone in (["--ngram-min", "1"], ["--ngram-max", "6"], ["--suffix-cache-tokens", "9"]):
        with pytest.raises(SystemExit):
            draft_config(["--model", "m", "--drafter", "ngram", *gone], {})


def test_hybrid_drafter_copies_recurring_ngrams_and_drafts_with_the_model_otherwise(tiny_pair):
    """A call whose sequence ends in a recurring n-gram proposes what followed it, one-hot and
    without a pass; any other drafts with the model; and the model's cache catches up on the
    copied tokens, so its next proposal is the one a plain model drafter makes on the same
    sequence."""
    config = dataclasses.replace(model_service_config(DraftConfig, tiny_pair.draft), quantize="none")
    hybrid = draft_server.load_runner(dataclasses.replace(config, drafter="hybrid", ngram_min=2, ngram_max=3))
    plain = draft_server.load_runner(config)
    assert hybrid.describe().model_id.endswith("+lookup[2..3]")

    fresh = [5, 17, 99, 200, 31]  # no n-gram recurs: the model drafts
    drafted = hybrid.propose_one(ProposeCall("h", 0, fresh, 3, GREEDY, 0))
    assert drafted.processed_tokens > 0 and drafted.probs is not None
    assert drafted.token_ids == plain.propose_one(ProposeCall("p", 0, fresh, 3, GREEDY, 0)).token_ids

    # Keep the first draft, then a sequence that ends in "17 99" again: copy "200 31 …".
    sequence = [*fresh, drafted.token_ids[0], 5, 17, 99]
    copied = hybrid.propose_one(ProposeCall("h", len(fresh) + 1, sequence[len(fresh) + 1 :], 3, SAMPLED, 1))
    assert copied.token_ids == [200, 31, drafted.token_ids[0]]
    assert copied.deterministic and copied.probs is None and copied.processed_tokens == 0
    assert hybrid.looked_up_proposals == 1

    # Two copied tokens accepted, then a token that breaks the pattern: the model drafts again,
    # running every token its cache has not seen, and agrees with a drafter that saw them all.
    sequence += [200, 31, 250]
    after = hybrid.propose_one(ProposeCall("h", len(sequence) - 1, [250], 3, GREEDY, 2))
    # First pass: 5 17 99 200 31 250 (the lookup call ran none); then one token a step.
    assert after.processed_tokens == 6 + 2
    expected = plain.propose_one(ProposeCall("p2", 0, sequence, 3, GREEDY, 0))
    assert after.token_ids == expected.token_ids
    torch.testing.assert_close(after.probs, expected.probs)
    assert dataclasses.replace(config, drafter="hybrid", ngram_min=3, ngram_max=2).problem() is not None


def test_copies_may_exceed_k_and_a_copy_only_call_never_runs_the_model(tiny_pair, ngram):
    config = dataclasses.replace(model_service_config(DraftConfig, tiny_pair.draft), quantize="none")
    hybrid = draft_server.load_runner(dataclasses.replace(config, drafter="hybrid", ngram_min=2, ngram_max=3))
    plain = draft_server.load_runner(config)
    assert hybrid.describe().copies and ngram.describe().copies and not plain.describe().copies
    repeating = [5, 17, 99, 200, 31, 40, 5, 17, 99]
    # K = 1 from the model, but a copy may carry up to max_copied_tokens = 4.
    long_copy = hybrid.propose_one(ProposeCall("a", 0, repeating, 1, GREEDY, 0, max_copied_tokens=4))
    assert long_copy.token_ids == [200, 31, 40, 5] and long_copy.copied
    assert ngram.propose_one(ProposeCall("n4", 0, repeating, 1, GREEDY, 0, max_copied_tokens=4)).token_ids == [
        200,
        31,
        40,
        5,
    ]
    # Copy-only (K = 0): a copy when one exists, else nothing, and no pass either way.
    only = hybrid.propose_one(ProposeCall("b", 0, repeating, 0, GREEDY, 0, max_copied_tokens=2))
    assert only.token_ids == [200, 31] and only.processed_tokens == 0
    nothing = hybrid.propose_one(ProposeCall("c", 0, [5, 17, 99, 200], 0, SAMPLED, 0, max_copied_tokens=2))
    assert nothing.token_ids == [] and not nothing.copied and nothing.processed_tokens == 0
    # The session still holds the sequence: the next call sends only what follows it.
    follow = hybrid.propose_one(ProposeCall("c", 4, [31], 2, GREEDY, 0))
    assert follow.token_ids == plain.propose_one(ProposeCall("p", 0, [5, 17, 99, 200, 31], 2, GREEDY, 0)).token_ids
    with pytest.raises(InvalidArgument, match="num_tokens must be in \\[1"):
        plain.propose_one(ProposeCall("d", 0, repeating, 0, GREEDY, 0, max_copied_tokens=2))  # the model cannot copy
    with pytest.raises(InvalidArgument, match="num_tokens must be in \\[1"):
        hybrid.propose_one(ProposeCall("e", 0, repeating, 0, GREEDY, 0))  # K = 0 without copies asks for nothing
    with pytest.raises(InvalidArgument, match="max_copied_tokens"):
        hybrid.propose_one(ProposeCall("f", 0, repeating, 1, GREEDY, 0, max_copied_tokens=999))
    # An exact cap: 0 means no copy this call, so the model drafts even where a copy exists.
    model = hybrid.propose_one(ProposeCall("g", 0, repeating, 2, GREEDY, 0, max_copied_tokens=0))
    assert not model.copied and model.processed_tokens > 0
    assert model.token_ids == plain.propose_one(ProposeCall("q", 0, repeating, 2, GREEDY, 0)).token_ids
    short = hybrid.propose_one(ProposeCall("h", 0, repeating, 3, GREEDY, 0, max_copied_tokens=1))
    assert short.token_ids == [200] and short.copied
