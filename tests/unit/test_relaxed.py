"""Relaxed acceptance (a lossy opt-in): the pure rule, the chain's OR, the target runner's
flags, and how a request's mode and parameters are validated and defaulted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.config import CoordinatorConfig, parse_config
from coordinator.requests import GenerationRequest, acceptance_of
from specdec.errors import InvalidArgument
from specdec.sampling.chain import count_accepted, decide_round
from specdec.sampling.probs import SamplingParams
from specdec.sampling.relaxed import (
    DEFAULT_DELTA,
    DEFAULT_TOP_N,
    RelaxedAcceptance,
    check_relaxed,
    relaxed_accepts,
    relaxed_verdicts,
)
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()


def passes(row: list[float], token: int, top_n: int, delta: float) -> bool:
    """The relaxed test for one draft token against one raw distribution."""
    return bool(relaxed_accepts(torch.tensor([row]), torch.tensor([token]), top_n, delta)[0])


# --- the pure rule -------------------------------------------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_a_token_the_request_bans_is_never_relaxed_in(params):
    """logit_bias -100 (OpenAI's ban) leaves a float32 row about 1e-44 of mass: over a small
    vocabulary, with the widest top-n and delta, the rule alone would let it in."""
    vocab, banned = 12, 5
    logits = torch.zeros(2, vocab)  # [K + 1, V]: a flat row, the draft token's and the bonus's
    logits[:, banned] -= 100.0  # as `biased` leaves it
    draft = torch.tensor([banned])
    target_probs = torch.softmax(logits[:1], dim=-1)[:, banned]
    widest = RelaxedAcceptance(top_n=16, delta=1.0)
    assert relaxed_accepts(torch.softmax(logits[:1], dim=-1), draft, 16, 1.0).tolist() == [True]
    biased = dataclasses.replace(params, logit_bias=((banned, -100.0),))
    assert relaxed_verdicts(widest, biased, logits, draft, target_probs).tolist() == [False]
    lowered = dataclasses.replace(params, logit_bias=((banned, -99.0),))  # not a ban: the rule decides
    assert relaxed_verdicts(widest, lowered, logits, draft, target_probs).tolist() == [True]


def test_only_tokens_among_the_top_n_pass():
    row = [0.4, 0.3, 0.2, 0.1]
    assert [passes(row, token, top_n=2, delta=1.0) for token in range(4)] == [True, True, False, False]
    assert [passes(row, token, top_n=3, delta=1.0) for token in range(4)] == [True, True, True, False]


def test_top_n_one_passes_only_the_argmax():
    assert [passes([0.3, 0.5, 0.2], token, top_n=1, delta=1.0) for token in range(3)] == [False, True, False]


def test_the_delta_boundary_is_inclusive():
    # 0.5 - 0.25 = 0.25 exactly in float32: a token exactly delta below the top-1 passes.
    row = [0.5, 0.25, 0.25, 0.0]
    assert passes(row, 1, top_n=3, delta=0.25)
    assert not passes(row, 1, top_n=3, delta=0.2)
    assert passes(row, 0, top_n=3, delta=0.0), "the top-1 itself is never further than 0 from itself"


def test_delta_zero_passes_only_ties_with_the_top_1():
    row = [0.4, 0.4, 0.2]
    assert [passes(row, token, top_n=3, delta=0.0) for token in range(3)] == [True, True, False]


def test_a_tie_at_the_nth_place_counts_every_tied_token_in():
    row = [0.4, 0.2, 0.2, 0.2]  # three tokens share second place
    assert [passes(row, token, top_n=2, delta=1.0) for token in range(4)] == [True, True, True, True]
    assert [passes(row, token, top_n=1, delta=1.0) for token in range(4)] == [True, False, False, False]


def test_a_token_without_mass_never_passes():
    assert not passes([1.0, 0.0, 0.0], 1, top_n=3, delta=1.0)


def test_each_row_is_tested_against_its_own_distribution():
    raw = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])  # [K, V]
    assert relaxed_accepts(raw, torch.tensor([1, 1]), 2, 0.3).tolist() == [True, False]  # 0.2 < 0.7 - 0.3
    assert relaxed_accepts(raw, torch.tensor([1, 1]), 2, 0.5).tolist() == [True, True]
    assert relaxed_accepts(raw, torch.tensor([0, 2]), 16, 0.0).tolist() == [True, True]  # top_n past V: all ranks


def test_no_drafts_no_flags():
    assert relaxed_accepts(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), 3, 0.3).tolist() == []


@pytest.mark.parametrize(
    ("top_n", "delta", "field", "message"),
    [
        (0, 0.3, "relaxed_top_n", r"relaxed_top_n must be an integer in \[1, 16\]; got 0"),
        (17, 0.3, "relaxed_top_n", r"relaxed_top_n must be an integer in \[1, 16\]; got 17"),
        (3, -0.1, "relaxed_delta", r"relaxed_delta must be a probability gap in \[0, 1\]; got -0.1"),
        (3, 1.5, "relaxed_delta", r"relaxed_delta must be a probability gap in \[0, 1\]"),
        (3, float("nan"), "relaxed_delta", r"relaxed_delta must be a probability gap in \[0, 1\]; got nan"),
    ],
)
def test_parameters_out_of_range_are_refused_by_name(top_n, delta, field, message):
    with pytest.raises(InvalidArgument, match=message) as refused:
        check_relaxed(top_n, delta)
    assert refused.value.field == field


def test_the_range_ends_are_accepted():
    assert check_relaxed(1, 0.0) == RelaxedAcceptance(1, 0.0)
    assert check_relaxed(16, 1.0) == RelaxedAcceptance(16, 1.0)


# --- the coordinator's OR ------------------------------------------------------------------


def test_exact_acceptance_still_accepts_without_the_relaxed_test():
    assert count_accepted([1.0, 1.0], [1.0, 1.0], [0.5, 0.5], relaxed_accepts=[False, False]) == 2


def test_the_relaxed_test_keeps_a_token_the_exact_rule_rejects():
    # Greedy: position 0 is the argmax, position 1 the runner-up the relaxed test passed.
    outcome = decide_round([1.0, 0.0, 0.0], [1.0] * 3, [0.5] * 3, [7, 8, 9], 10, relaxed_accepts=[False, True, False])
    assert (outcome.num_accepted, outcome.next_token_id, outcome.relaxed_accepted) == (2, 9, 1)
    assert outcome.committed([4, 5, 6]) == [4, 5, 9]


def test_the_first_position_neither_rule_accepts_ends_the_round():
    outcome = decide_round([0.0, 1.0], [1.0, 1.0], [0.5, 0.5], [7, 8], 10, relaxed_accepts=[False, True])
    assert (outcome.num_accepted, outcome.next_token_id, outcome.relaxed_accepted) == (0, 7, 0)


def test_a_round_kept_whole_by_the_relaxed_test_ends_in_the_bonus():
    outcome = decide_round([0.0, 0.0], [1.0, 1.0], [0.5, 0.5], [7, 8], 10, relaxed_accepts=[True, True])
    assert (outcome.num_accepted, outcome.next_token_id, outcome.relaxed_accepted) == (2, 10, 2)


def test_without_relaxed_flags_the_round_is_exact():
    exact = decide_round([1.0, 0.0], [1.0, 1.0], [0.5, 0.5], [7, 8], 10)
    assert (exact.num_accepted, exact.next_token_id, exact.relaxed_accepted) == (1, 8, 0)


# --- the target runner -----------------------------------------------------------------------


def raw_rows(runner: TargetRunner, tokens: list[int]) -> torch.Tensor:
    """Reference: softmax of an uncached forward's logits; row i predicts tokens[i + 1]. [N, V]"""
    with torch.inference_mode():
        return torch.softmax(runner.model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def runner_up(runner: TargetRunner, tokens: list[int]) -> int:
    """The target's second likeliest next token: one the relaxed test can pass, the exact one cannot."""
    return int(raw_rows(runner, tokens)[-1].topk(2).indices[1])


def test_the_target_flags_each_draft_on_its_raw_distribution(target_runner):
    vocab = target_runner.loaded.vocab_size
    prompt = [3, 14, 15, 92, 65, 35]
    # Drafts chosen one at a time as the target's runner-up, so each flag is the rule's call.
    drafts: list[int] = []
    for _ in range(3):
        drafts.append(runner_up(target_runner, prompt + drafts))
    raw = raw_rows(target_runner, prompt + drafts)[len(prompt) - 1 : -1]  # [K, V]: the rows predicting each draft
    for relaxed in (RelaxedAcceptance(2, 1.0), RelaxedAcceptance(1, 1.0), RelaxedAcceptance(2, 0.0)):
        result = target_runner.verify_one(
            VerifyCall("s", 0, prompt, drafts, torch.zeros(0, vocab), GREEDY, 0, relaxed=relaxed)
        )
        expected = relaxed_accepts(raw, torch.tensor(drafts), relaxed.top_n, relaxed.delta).tolist()
        assert result.relaxed_accepts == expected, relaxed
        assert result.draft_token_target_probs == [0.0, 0.0, 0.0], "a runner-up is never the greedy argmax"
        target_runner.end_session("s")
    assert result.relaxed_accepts == [False] * 3  # top-2 within 0: only a tie with the first passes
    wide = target_runner.verify_one(
        VerifyCall("s", 0, prompt, drafts, torch.zeros(0, vocab), GREEDY, 0, relaxed=RelaxedAcceptance(2, 1.0))
    )
    assert wide.relaxed_accepts == [True] * 3
    target_runner.end_session("s")


def test_an_exact_call_computes_no_flags(target_runner):
    vocab = target_runner.loaded.vocab_size
    result = target_runner.verify_one(VerifyCall("s", 0, [1, 2, 3], [4, 5], torch.zeros(0, vocab), GREEDY, 0))
    assert result.relaxed_accepts == []
    target_runner.end_session("s")


def test_a_sampled_request_never_relaxes_past_its_own_top_k(target_runner):
    """top_k = 1 leaves the argmax alone: the runner-up passes the raw test, not the request's."""
    vocab = target_runner.loaded.vocab_size
    prompt = [7, 8, 9, 10]
    draft = [runner_up(target_runner, prompt)]
    uniform = torch.full((1, vocab), 1.0 / vocab)
    for params, expected in ((SamplingParams(temperature=1.0), [True]), (SamplingParams(1.0, top_k=1), [False])):
        result = target_runner.verify_one(
            VerifyCall("s", 0, prompt, draft, uniform, params, 3, relaxed=RelaxedAcceptance(2, 1.0))
        )
        assert result.relaxed_accepts == expected, params
        target_runner.end_session("s")


def test_a_tree_call_with_relaxed_parameters_is_refused(target_runner):
    vocab = target_runner.loaded.vocab_size
    call = VerifyCall(
        "s", 0, [1, 2], [3, 4], torch.zeros(0, vocab), GREEDY, 0, parents=(0, 0), relaxed=RelaxedAcceptance()
    )
    with pytest.raises(InvalidArgument, match="relaxed is set with draft_parents"):
        target_runner.verify_one(call)


# --- a request's mode ----------------------------------------------------------------------

EXACT_DEFAULT = CoordinatorConfig()
RELAXED_DEFAULT = dataclasses.replace(CoordinatorConfig(), acceptance="relaxed", relaxed_top_n=5, relaxed_delta=0.25)


def test_an_unset_mode_takes_the_servers_default():
    assert acceptance_of(GenerationRequest(prompt="x"), EXACT_DEFAULT) is None
    assert acceptance_of(GenerationRequest(prompt="x"), RELAXED_DEFAULT) == RelaxedAcceptance(5, 0.25)


def test_a_relaxed_request_takes_the_servers_parameters_where_it_leaves_them_unset():
    request = GenerationRequest(prompt="x", acceptance_mode="relaxed", relaxed_delta=0.5)
    assert acceptance_of(request, EXACT_DEFAULT) == RelaxedAcceptance(DEFAULT_TOP_N, 0.5)
    assert acceptance_of(request, RELAXED_DEFAULT) == RelaxedAcceptance(5, 0.5)
    assert acceptance_of(GenerationRequest(prompt="x", acceptance_mode="relaxed"), EXACT_DEFAULT) == (
        RelaxedAcceptance(DEFAULT_TOP_N, DEFAULT_DELTA)
    )


def test_an_explicit_exact_request_is_exact_under_a_relaxed_default():
    assert acceptance_of(GenerationRequest(prompt="x", acceptance_mode="exact"), RELAXED_DEFAULT) is None


def test_a_tree_request_stays_exact_under_a_relaxed_default_and_may_not_ask_for_relaxed():
    assert acceptance_of(GenerationRequest(prompt="x", tree_widths=(2, 1)), RELAXED_DEFAULT) is None
    with pytest.raises(InvalidArgument, match=r"relaxed does not apply to token trees \(tree_widths\)") as refused:
        acceptance_of(GenerationRequest(prompt="x", tree_widths=(2, 1), acceptance_mode="relaxed"), EXACT_DEFAULT)
    assert refused.value.field == "acceptance_mode"


@pytest.mark.parametrize("name", ["relaxed_top_n", "relaxed_delta"])
@pytest.mark.parametrize("mode", ["exact", ""])
def test_relaxed_parameters_in_an_exact_request_are_refused(name, mode):
    request = GenerationRequest(prompt="x", acceptance_mode=mode, **{name: 1})
    with pytest.raises(InvalidArgument, match=f"{name} applies only to acceptance_mode relaxed") as refused:
        acceptance_of(request, EXACT_DEFAULT)
    assert refused.value.field == name


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(
        InvalidArgument, match=r"acceptance_mode must be one of exact, relaxed .*got 'lossy'"
    ) as refused:
        acceptance_of(GenerationRequest(prompt="x", acceptance_mode="lossy"), EXACT_DEFAULT)
    assert refused.value.field == "acceptance_mode"


def test_a_requests_parameters_out_of_range_are_refused_by_name():
    request = GenerationRequest(prompt="x", acceptance_mode="relaxed", relaxed_top_n=40)
    with pytest.raises(InvalidArgument, match=r"relaxed_top_n must be an integer in \[1, 16\]; got 40"):
        acceptance_of(request, EXACT_DEFAULT)


def test_no_flag_makes_a_lossy_rule_the_servers_default(capsys):
    """The default is exact, with no flag to change it: relaxed acceptance is the request's own
    opt-in (its parameters the request's, or the module's defaults)."""
    config = parse_config(["--draft", "d:1", "--target", "t:1", "--tokenizer", "x"], env={})
    assert (config.acceptance, config.relaxed_top_n, config.relaxed_delta) == ("exact", DEFAULT_TOP_N, DEFAULT_DELTA)
    with pytest.raises(SystemExit):
        parse_config(
            ["--draft", "d:1", "--target", "t:1", "--tokenizer", "x"], env={"SPECDEC_COORDINATOR_ACCEPTANCE": "relaxed"}
        )
    assert "SPECDEC_COORDINATOR_ACCEPTANCE: no setting of this service has that variable" in capsys.readouterr().err
    for bad, said in (
        (["--relaxed-top-n", "4"], "unrecognized arguments"),
        (["--acceptance", "relaxed"], "unrecognized arguments"),
    ):
        with pytest.raises(SystemExit):
            parse_config(["--draft", "d:1", "--target", "t:1", "--tokenizer", "x", *bad], env={})
        assert said in capsys.readouterr().err
