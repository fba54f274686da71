"""Batched verification: several sessions in one forward pass give what each gives alone.

Every test runs the same calls through two runners on the same weights, one session at a
time (`verify_one`, today's path) and batched (`verify_batch`), and compares: greedy results
exactly, target probabilities within float32 rounding, and the KV caches left behind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.engine import attention, quantize
from specdec.engine.batching import batch_groups, call_waves
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from specdec.sampling.probs import SamplingParams
from specdec.sampling.relaxed import RelaxedAcceptance
from target_service import runner as runner_module
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
# Batched and lone passes sum in different orders; in float32 they differ by a few ulps.
PROB_TOLERANCE = dict(atol=1e-5, rtol=1e-4)
KV_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    loaded.model.set_attn_implementation(attention.NAME)  # as the target service runs on CPU
    return loaded


@pytest.fixture(scope="module")
def int8_loaded(tiny_pair):
    """The tiny target as the service runs an int8 target on CPU: per-token Linear layers,
    attention row by row (target_service.loading)."""
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    quantize.quantize_int8(loaded.model)
    loaded.model.set_attn_implementation(attention.EVERY_ROW)
    return dataclasses.replace(loaded, quantization=quantize.INT8_LABEL)


def make_runner(loaded, **kwargs) -> TargetRunner:
    return TargetRunner(
        loaded, max_sessions=kwargs.pop("max_sessions", 16), session_ttl_s=60, max_speculative_tokens=8, **kwargs
    )


def tokens(seed: int, count: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def draft_probs(seed: int, num_draft: int, vocab: int) -> torch.Tensor:
    """A full draft distribution per draft token. [K, V]"""
    return torch.softmax(2.0 * torch.randn(num_draft, vocab, generator=torch.Generator().manual_seed(seed)), dim=-1)


def prefill(runners, session_id: str, prompt: list[int]) -> None:
    for runner in runners:
        runner.verify_one(VerifyCall(session_id, 0, prompt, [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0))


def holds(runner: TargetRunner, session_id: str) -> bool:
    try:
        runner.sessions.open(session_id, 1)
    except SessionNotFound:
        return False
    return True


def alone(runner: TargetRunner, calls: list[VerifyCall]) -> list:
    results = []
    for call in calls:
        try:
            results.append(runner.verify_one(call))
        except Exception as exc:  # noqa: BLE001 - compared with the batched item
            results.append(exc)
    return results


def mixed_calls(runners, params: SamplingParams, return_distributions: bool) -> list[VerifyCall]:
    """Sessions with different pasts and different numbers of new and draft tokens: decode
    rounds, a rollback that drops two draft tokens, and two brand-new sessions' prompt
    prefills (one with drafts, one without)."""
    vocab = runners[0].loaded.vocab_size
    pasts = {
        "short": tokens(1, 3, vocab),
        "medium": tokens(2, 17, vocab),
        "long": tokens(3, 41, vocab),
        "rollback": tokens(4, 12, vocab),
    }
    for session_id, prompt in pasts.items():
        prefill(runners, session_id, prompt)
    # "rollback" holds 12 prompt tokens + 3 drafts; the round keeps the prompt and one draft.
    for runner in runners:
        runner.verify_one(VerifyCall("rollback", 12, [7], [8, 9, 10], draft_probs(0, 3, vocab), params, 0))
    specs = [  # session, keep_tokens, new tokens, draft tokens
        ("short", 3, tokens(11, 1, vocab), tokens(12, 4, vocab)),
        ("medium", 17, tokens(13, 2, vocab), tokens(14, 1, vocab)),
        ("long", 41, tokens(15, 1, vocab), tokens(16, 6, vocab)),
        ("rollback", 14, tokens(17, 1, vocab), tokens(18, 3, vocab)),
        ("fresh", 0, tokens(19, 9, vocab), tokens(20, 2, vocab)),
        ("prompt-only", 0, pasts["long"], []),
    ]
    return [
        VerifyCall(
            session_id,
            keep,
            new,
            drafts,
            draft_probs(30 + i, len(drafts), vocab),
            params,
            seed=100 + i,
            return_distributions=return_distributions,
        )
        for i, (session_id, keep, new, drafts) in enumerate(specs)
    ]


def assert_same_caches(solo: TargetRunner, batched: TargetRunner, session_ids, bitwise: bool = False) -> None:
    tolerance = {"atol": 0.0, "rtol": 0.0} if bitwise else KV_TOLERANCE
    for session_id in session_ids:
        expected, actual = solo.sessions.open(session_id, 1), batched.sessions.open(session_id, 1)
        assert actual.tokens == expected.tokens
        assert actual.cached_tokens == expected.cached_tokens
        assert len(actual.cache.layers) == len(expected.cache.layers)
        for want, got in zip(expected.cache.layers, actual.cache.layers):
            assert got.keys.shape == want.keys.shape and got.values.shape == want.values.shape
            torch.testing.assert_close(got.keys, want.keys, **tolerance)
            torch.testing.assert_close(got.values, want.values, **tolerance)


def test_greedy_batch_equals_each_session_alone(loaded):
    solo, batched = make_runner(loaded), make_runner(loaded)
    batched.max_padding_ratio = float("inf")  # one pass for all, prompt prefill included
    calls = mixed_calls([solo, batched], GREEDY, return_distributions=False)
    expected = alone(solo, calls)
    passes_before = batched.batched_forwards
    results = batched.verify_batch(calls)
    assert batched.batched_forwards == passes_before + 1 and batched.max_batch_size_seen == len(calls)
    for call, want, got in zip(calls, expected, results):
        assert got.batch_size == len(calls)
        assert got.recovered_token_ids == want.recovered_token_ids, call.session_id
        assert got.bonus_token_id == want.bonus_token_id, call.session_id
        assert got.draft_token_target_probs == want.draft_token_target_probs, call.session_id
        assert (got.processed_tokens, got.sequence_length) == (want.processed_tokens, want.sequence_length), (
            call.session_id
        )
    assert_same_caches(solo, batched, [call.session_id for call in calls])


def test_sampled_target_probs_equal_unbatched_within_float32_rounding(loaded):
    solo, batched = make_runner(loaded), make_runner(loaded)
    batched.max_padding_ratio = float("inf")
    calls = mixed_calls([solo, batched], SAMPLED, return_distributions=True)
    expected = alone(solo, calls)
    results = batched.verify_batch(calls)
    assert all(result.batch_size == len(calls) for result in results)
    for call, want, got in zip(calls, expected, results):
        assert got.target_probs.shape == want.target_probs.shape == (len(call.draft_token_ids) + 1, loaded.vocab_size)
        torch.testing.assert_close(got.target_probs, want.target_probs, **PROB_TOLERANCE)
        torch.testing.assert_close(
            torch.tensor(got.draft_token_target_probs), torch.tensor(want.draft_token_target_probs), **PROB_TOLERANCE
        )
        # Same seed, probabilities equal to a few ulps: the inverse-CDF draws land on the same tokens.
        assert got.recovered_token_ids == want.recovered_token_ids and got.bonus_token_id == want.bonus_token_id
    assert_same_caches(solo, batched, [call.session_id for call in calls])


def test_an_int8_targets_batch_is_bitwise_each_session_alone(int8_loaded):
    """As the service runs an int8 target on CPU (per-token Linear layers, attention row by
    row): a padded batch's rows, prompts and rollbacks among them, give bitwise the
    probabilities and cache entries each session gets alone, so a greedy request's output does
    not depend on what else is in its passes. Under SDPA over the padded batch they differed by
    float32 rounding turned into int8 quantisation steps."""
    solo, batched = make_runner(int8_loaded), make_runner(int8_loaded)
    batched.max_padding_ratio = float("inf")
    assert solo.per_token_exact
    calls = mixed_calls([solo, batched], SAMPLED, return_distributions=True)
    expected = alone(solo, calls)
    results = batched.verify_batch(calls)
    assert all(result.batch_size == len(calls) for result in results)
    for call, want, got in zip(calls, expected, results):
        assert torch.equal(got.target_probs, want.target_probs), call.session_id
        assert got.recovered_token_ids == want.recovered_token_ids and got.bonus_token_id == want.bonus_token_id
    assert_same_caches(solo, batched, [call.session_id for call in calls], bitwise=True)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_alike_calls_are_concluded_together_as_each_alone(loaded, params, monkeypatch):
    """Calls with the same settings and nothing extra to return share one conclusion
    (specdec.sampling.together): the same tokens as each call alone; a call with penalties
    among them is concluded on its own."""
    solo, batched = make_runner(loaded), make_runner(loaded)
    batched.max_padding_ratio = float("inf")
    calls = mixed_calls([solo, batched], params, return_distributions=False)
    calls[1] = dataclasses.replace(calls[1], params=dataclasses.replace(params, presence_penalty=0.5))
    expected = alone(solo, calls)
    together = []
    real = runner_module.verify_outputs_together
    monkeypatch.setattr(runner_module, "verify_outputs_together", lambda *args: together.append(args[3]) or real(*args))
    results = batched.verify_batch(calls)
    assert len(together) == 1  # one group, in the pass's order
    assert sorted(together[0]) == sorted(call.draft_token_ids for i, call in enumerate(calls) if i != 1)
    for call, want, got in zip(calls, expected, results):
        assert got.batch_size == len(calls)
        torch.testing.assert_close(
            torch.tensor(got.draft_token_target_probs), torch.tensor(want.draft_token_target_probs), **PROB_TOLERANCE
        )
        assert got.recovered_token_ids == want.recovered_token_ids, call.session_id
        assert got.bonus_token_id == want.bonus_token_id, call.session_id
        assert (got.processed_tokens, got.sequence_length) == (want.processed_tokens, want.sequence_length)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_relaxed_flags_in_a_batch_equal_each_call_alone(loaded, params):
    """Relaxed calls (every other one) share the pass with exact ones: each gets the flags it
    gets alone, and the exact ones none."""
    solo, batched = make_runner(loaded), make_runner(loaded)
    batched.max_padding_ratio = float("inf")
    relaxed = RelaxedAcceptance(top_n=16, delta=1.0)
    calls = [
        dataclasses.replace(call, relaxed=relaxed if i % 2 == 0 else None)
        for i, call in enumerate(mixed_calls([solo, batched], params, return_distributions=False))
    ]
    expected = alone(solo, calls)
    results = batched.verify_batch(calls)
    flags = []
    for call, want, got in zip(calls, expected, results):
        assert got.batch_size == len(calls)
        assert got.relaxed_accepts == want.relaxed_accepts, call.session_id
        assert len(got.relaxed_accepts) == (len(call.draft_token_ids) if call.relaxed else 0), call.session_id
        flags += got.relaxed_accepts
    assert True in flags and False in flags, "the calls should hold drafts on both sides of the rule"


def greedy_continuation(loaded, prompt: list[int], count: int) -> list[int]:
    """The target's own one-token-at-a-time argmax chain (EOS is just another token here)."""
    chain = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            chain.append(int(loaded.model(torch.tensor([chain])).logits[0, -1].argmax()))
    return chain[len(prompt) :]


def test_batched_rounds_decode_exactly_the_greedy_continuation(loaded):
    """Speculative rounds as the coordinator runs them, all sessions verified together every
    round: drafts that are right for a while and then wrong (so most rounds roll back), with
    different prompt lengths and K. Each round matches the same round run alone, and every
    session's committed tokens are the target's own greedy continuation."""
    vocab, rounds = loaded.vocab_size, 12
    solo, batched = make_runner(loaded), make_runner(loaded)
    prompts = {f"s{i}": tokens(50 + i, length, vocab) for i, length in enumerate((4, 11, 19, 30))}
    truth = {session_id: greedy_continuation(loaded, prompt, 5 * rounds + 8) for session_id, prompt in prompts.items()}
    generated: dict[str, list[int]] = {session_id: [] for session_id in prompts}
    held = dict.fromkeys(prompts, 0)  # tokens the service still holds as valid
    unsent = dict(prompts)  # committed tokens the service has not seen
    for round_index in range(rounds):
        calls = []
        for i, session_id in enumerate(prompts):
            k = 1 + (i + round_index) % 4
            right = (round_index + i) % (k + 1)  # how many drafts agree with the target
            upcoming = truth[session_id][len(generated[session_id]) :][:k]
            drafts = upcoming[:right] + [(t + 1) % vocab for t in upcoming[right:]]
            calls.append(
                VerifyCall(session_id, held[session_id], unsent[session_id], drafts, torch.zeros(0), GREEDY, 0)
            )
        expected = alone(solo, calls)
        results = batched.verify_batch(calls)
        for call, want, got in zip(calls, expected, results):
            assert got.batch_size == len(calls)
            assert (got.recovered_token_ids, got.bonus_token_id) == (want.recovered_token_ids, want.bonus_token_id)
            assert got.draft_token_target_probs == want.draft_token_target_probs
            accepted = 0
            while accepted < len(call.draft_token_ids) and got.draft_token_target_probs[accepted] == 1.0:
                accepted += 1
            last = got.recovered_token_ids[accepted] if accepted < len(call.draft_token_ids) else got.bonus_token_id
            generated[call.session_id] += call.draft_token_ids[:accepted] + [last]
            held[call.session_id] = call.keep_tokens + len(call.new_tokens) + accepted
            unsent[call.session_id] = [last]
    for session_id in prompts:
        assert generated[session_id] == truth[session_id][: len(generated[session_id])], session_id
        assert len(generated[session_id]) > 2 * rounds
    assert batched.batched_forwards == rounds and batched.max_batch_size_seen == len(prompts)
    assert_same_caches(solo, batched, list(prompts))


def test_an_error_in_one_item_fails_only_that_call(loaded):
    solo, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    for session_id, seed in (("a", 60), ("b", 61), ("e", 62)):
        prefill([solo, batched], session_id, tokens(seed, 5, vocab))
    calls = [
        VerifyCall("a", 5, [3], [4, 5], torch.zeros(0), GREEDY, 0),
        VerifyCall("nobody", 4, [3], [4], torch.zeros(0), GREEDY, 0),  # NOT_FOUND
        VerifyCall("v", 0, [vocab + 1], [4], torch.zeros(0), GREEDY, 0),  # id outside the vocabulary
        VerifyCall("e", 99, [3], [4], torch.zeros(0), GREEDY, 0),  # keeps more than the session holds
        VerifyCall("c", 0, [1, 2, 3], [4], torch.zeros(3, 5), SAMPLED, 0),  # draft distributions of the wrong width
        VerifyCall("b", 5, [6, 7], [8], torch.zeros(0), GREEDY, 0),
    ]
    results = batched.verify_batch(calls)
    assert isinstance(results[1], SessionNotFound)
    assert isinstance(results[2], InvalidArgument) and "outside the vocabulary" in str(results[2])
    assert isinstance(results[3], InvalidArgument) and "keep_tokens=99" in str(results[3])
    assert isinstance(results[4], InvalidArgument) and "draft distributions have shape" in str(results[4])
    good = [calls[0], calls[5]]
    for want, got in zip(alone(solo, good), [results[0], results[5]]):
        assert got.batch_size == 2
        assert (got.recovered_token_ids, got.bonus_token_id, got.sequence_length) == (
            want.recovered_token_ids,
            want.bonus_token_id,
            want.sequence_length,
        )
    assert_same_caches(solo, batched, ["a", "b", "e"])  # "e" is as it was: a refused call changes nothing
    assert not any(holds(batched, session_id) for session_id in ("c", "v", "nobody"))


def test_a_session_over_the_kv_budget_fails_alone(loaded):
    per_token = make_runner(loaded).kv_bytes_per_token
    solo = make_runner(loaded, max_kv_bytes=40 * per_token)
    batched = make_runner(loaded, max_kv_bytes=40 * per_token)
    batched.max_padding_ratio = float("inf")
    vocab = loaded.vocab_size
    prefill([solo, batched], "small", tokens(70, 6, vocab))
    calls = [
        VerifyCall("small", 6, [5], [6, 7], torch.zeros(0), GREEDY, 0),
        VerifyCall("huge", 0, tokens(71, 45, vocab), [1], torch.zeros(0), GREEDY, 0),  # 46 tokens > 40
        VerifyCall("other", 0, tokens(72, 10, vocab), [2], torch.zeros(0), GREEDY, 0),
    ]
    expected = alone(solo, calls)
    results = batched.verify_batch(calls)
    assert isinstance(expected[1], ResourceExhausted) and isinstance(results[1], ResourceExhausted)
    assert str(results[1]) == str(expected[1])
    assert not holds(batched, "huge")
    for index in (0, 2):
        assert results[index].bonus_token_id == expected[index].bonus_token_id
        assert results[index].recovered_token_ids == expected[index].recovered_token_ids
    assert batched.max_batch_size_seen == 2
    assert_same_caches(solo, batched, ["small", "other"])


def test_the_kv_budget_counts_what_the_whole_pass_adds(loaded):
    """Two new sessions that fit alone but not together with an older one: admitting the
    second counts the first's pending tokens, so the least recently used session is evicted."""
    per_token = make_runner(loaded).kv_bytes_per_token
    runner = make_runner(loaded, max_kv_bytes=35 * per_token)
    runner.verify_one(VerifyCall("old", 0, tokens(80, 15, loaded.vocab_size), [], torch.zeros(0), GREEDY, 0))
    calls = [
        VerifyCall(f"new{i}", 0, tokens(81 + i, 12, loaded.vocab_size), [], torch.zeros(0), GREEDY, 0) for i in range(2)
    ]
    results = runner.verify_batch(calls)
    assert all(result.batch_size == 2 for result in results)
    assert runner.sessions.evicted == 1 and not holds(runner, "old")
    assert runner.sessions.kv_bytes() == 24 * per_token


def test_calls_for_one_session_run_in_order(loaded):
    solo, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    prefill([solo, batched], "x", tokens(90, 6, vocab))
    calls = [
        VerifyCall("y", 0, tokens(91, 5, vocab), [1, 2], torch.zeros(0), GREEDY, 0),
        VerifyCall("x", 6, [3], [4, 5], torch.zeros(0), GREEDY, 0),
        VerifyCall("y", 6, [9], [3], torch.zeros(0), GREEDY, 0),  # needs the first "y" call's tokens
    ]
    expected = alone(solo, calls)
    results = batched.verify_batch(calls)
    assert [r.batch_size for r in results] == [2, 2, 1]
    for want, got in zip(expected, results):
        assert (got.recovered_token_ids, got.bonus_token_id, got.sequence_length) == (
            want.recovered_token_ids,
            want.bonus_token_id,
            want.sequence_length,
        )
    assert_same_caches(solo, batched, ["x", "y"])


def test_a_prompt_prefill_among_decode_rounds_gets_its_own_pass(loaded):
    runner = make_runner(loaded)  # the default padding limit
    vocab = loaded.vocab_size
    for i in range(3):
        runner.verify_one(VerifyCall(f"d{i}", 0, tokens(100 + i, 10, vocab), [], torch.zeros(0), GREEDY, 0))
    calls = [VerifyCall(f"d{i}", 10, [1], [2, 3, 4], torch.zeros(0), GREEDY, 0) for i in range(3)]
    calls.append(VerifyCall("prompt", 0, tokens(110, 60, vocab), [5], torch.zeros(0), GREEDY, 0))
    results = runner.verify_batch(calls)
    assert [r.batch_size for r in results] == [3, 3, 3, 1]
    assert runner.batched_forwards == 1


def test_call_waves_keep_each_sessions_calls_in_order():
    assert call_waves([(s,) for s in ["a", "b", "a", "c", "a", "b"]]) == [[0, 1, 3], [2, 5], [4]]
    # A fork reads its parent: it waits for the parent's earlier call, and the parent's later
    # call waits for the fork.
    assert call_waves([("a",), ("f", "a"), ("b",), ("a",)]) == [[0, 2], [1], [3]]


def test_batch_groups_bound_the_padding():
    assert batch_groups([5, 5, 5, 100], 2.0) == [[0, 1, 2], [3]]
    assert batch_groups([11, 4, 5, 5], 2.0) == [[1, 2, 3, 0]]  # 4 rows × 11 = 44 ≤ 2 × 25 real tokens
    assert batch_groups([3, 60, 70, 2], 2.0) == [[3, 0], [1, 2]]
    assert batch_groups([1] * 8, 1.0) == [list(range(8))]
    assert batch_groups([], 2.0) == []


def test_call_waves_let_a_writer_share_the_wave_of_readers_before_it():
    # Forks (readers of "a") listed before a call on "a" start first and copy it as it was.
    assert call_waves([("f",), ("g",), ("a",)], [("a",), ("a",), ()]) == [[0, 1, 2]]
    # A fork after a call on its parent waits for that call: it copies the result.
    assert call_waves([("a",), ("f",), ("a",)], [(), ("a",), ()]) == [[0], [1, 2]]
    # Two writers of one session never share a wave, readers or not.
    assert call_waves([("a",), ("f",), ("a",), ("a",)], [(), ("a",), (), ()]) == [[0], [1, 2], [3]]


TREES = {  # session: (parents, new tokens this round)
    "short": ([0, 0, 1, 2], 1),
    "medium": ([0, 0, 0, 1, 4], 3),
    "long": ([0, 1, 2], 2),
}


def tree_calls(runners, params: SamplingParams, round_index: int, kept: dict | None = None) -> list[VerifyCall]:
    """A token tree per session: different pasts, shapes and numbers of new tokens. `kept`:
    per session, (committed length, the accepted path's tokens) from the round before."""
    vocab = runners[0].loaded.vocab_size
    calls = []
    for seed, (session_id, (parents, new)) in enumerate(TREES.items()):
        nodes = tokens(100 + 10 * round_index + seed, len(parents), vocab)
        probs = draft_probs(200 + 10 * round_index + seed, len(parents), vocab)
        if kept is None:
            keep, new_tokens = len(prefilled_tokens(runners[0], session_id)), tokens(300 + seed, new, vocab)
        else:
            keep, path = kept[session_id]
            new_tokens = path + tokens(400 + seed, 1, vocab)
        calls.append(
            VerifyCall(session_id, keep, new_tokens, nodes, probs, params, 7 + seed, True, parents=tuple(parents))
        )
    return calls


def prefilled_tokens(runner: TargetRunner, session_id: str) -> list[int]:
    return runner.sessions.open(session_id, 1).tokens


@pytest.mark.parametrize("model", ["loaded", "int8_loaded"], ids=["float32", "int8"])
def test_batched_trees_equal_each_tree_alone_and_keep_their_paths(model, request):
    """Token trees of several sessions share one pass (a 4D mask per row): every node's
    target distribution and every cache match the lone pass (an int8 target's bitwise); the
    next round, each session keeps a different accepted path from its cached nodes, batched
    again."""
    loaded = request.getfixturevalue(model)
    bitwise = bool(loaded.quantization)
    solo, batched = make_runner(loaded), make_runner(loaded)
    batched.max_padding_ratio = float("inf")
    vocab = loaded.vocab_size
    for seed, session_id in enumerate(TREES):
        prefill([solo, batched], session_id, tokens(seed, 5 + 9 * seed, vocab))
    kept = None
    for round_index in range(2):
        calls = tree_calls([solo, batched], SAMPLED, round_index, kept)
        expected = alone(solo, calls)
        passes_before = batched.batched_forwards
        results = batched.verify_batch(calls)
        assert batched.batched_forwards == passes_before + 1
        for call, want, got in zip(calls, expected, results):
            assert got.batch_size == len(calls) and len(got.recovered_token_ids) == len(call.parents) + 1
            tolerance = {"atol": 0.0, "rtol": 0.0} if bitwise else PROB_TOLERANCE
            torch.testing.assert_close(got.target_probs, want.target_probs, **tolerance)
            assert got.sequence_length == want.sequence_length == call.keep_tokens + len(call.new_tokens)
        assert_same_caches(solo, batched, list(TREES), bitwise)
        # Next round: "short" keeps nodes 1 -> 3, "medium" node 3, "long" nothing.
        paths = {"short": [1, 3], "medium": [3], "long": []}
        kept = {
            call.session_id: (
                call.keep_tokens + len(call.new_tokens),
                [call.draft_token_ids[n - 1] for n in paths[call.session_id]],
            )
            for call in calls
        }
    for runner in (solo, batched):  # the kept paths ran no second time
        assert runner.sessions.open("short", 1).tree is not None


def test_a_padded_batchs_rows_read_their_own_runs_of_keys():
    """attention._padded_runs: each row's keys, as the row-wise batch reads them; None (SDPA)
    where a row sees nothing or a float mask adds a bias."""
    seen = torch.tensor(
        [
            [[0, 1, 1, 0], [0, 1, 1, 1]],  # a past of 2 left-padded; 2 new tokens
            [[1, 1, 1, 0], [1, 1, 0, 1]],  # a tree node seeing the past, then its ancestor
        ],
        dtype=torch.bool,
    )[:, None]  # [B, 1, Q, L]
    runs = attention._padded_runs(seen, 2, 2, 4)
    assert runs is not None and runs[0] == [(1, 3, None), (1, 4, None)] and runs[1][0] == (0, 3, None)
    start, end, extra = runs[1][1]
    assert (start, end) == (0, 2) and extra is not None and extra.tolist() == [3]
    least = torch.finfo(torch.float32).min
    additive = torch.where(seen, 0.0, least)
    floats = attention._padded_runs(additive, 2, 2, 4)
    assert floats is not None and floats[0] == runs[0]
    assert attention._padded_runs(additive + 0.5 * seen, 2, 2, 4) is None  # a bias: SDPA's to add
    assert attention._padded_runs(torch.zeros(2, 1, 2, 4, dtype=torch.bool), 2, 2, 4) is None
    assert attention._padded_runs(None, 2, 2, 4) == [[(0, 3, None), (0, 4, None)]] * 2
