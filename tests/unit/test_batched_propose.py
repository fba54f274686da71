"""Batched proposals: several sessions' draft steps in one forward pass give what each gives
alone. Every test runs the same calls through two runners on the same weights, one call at a
time (`propose_one`) and batched (`propose_batch`), and compares tokens, distributions and
the sessions left behind."""

from __future__ import annotations

import grpc
import pytest
import torch

from draft_service.batched import step_all
from draft_service.runner import DraftRunner, ProposeCall
from specdec.engine.kv_pool import PoolCache
from specdec.engine.modeling import load_causal_lm
from specdec.errors import InvalidArgument, JobGivenUp, ModelOutputError, SessionNotFound, SpecDecError
from specdec.sampling.probs import SamplingParams

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0)
PROB_TOLERANCE = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    return load_causal_lm(str(tiny_pair.draft), "float32", "cpu")


def make_runner(loaded, static: bool = False, top_k: int = 0) -> DraftRunner:
    """`static`: its passes as --cuda-graphs on runs them (on CPU uncaptured): a decode batch
    then steps every session in its own extent, nothing padded in or split back. `top_k`: the
    draft's own cut of sampled rows (0: full rows, as most tests here compare them)."""
    runner = DraftRunner(loaded, max_sessions=16, session_ttl_s=60, max_speculative_tokens=8, proposal_top_k=top_k)
    if static:
        runner.max_batch_size = 8
        runner.use_static_passes("on")
    return runner


def tokens(seed: int, count: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(runner: DraftRunner, calls: list[ProposeCall]) -> list:
    results = []
    for call in calls:
        try:
            results.append(runner.propose_one(call))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)
    return results


def assert_same(batched: list, lone: list) -> None:
    for got, want in zip(batched, lone, strict=True):
        if isinstance(want, Exception):
            assert type(got) is type(want), (got, want)
            continue
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.probs, want.probs, **PROB_TOLERANCE)
        assert got.runner_up_ids == want.runner_up_ids
        torch.testing.assert_close(got.runner_up_probs, want.runner_up_probs, **PROB_TOLERANCE)
        assert got.sequence_length == want.sequence_length and got.processed_tokens == want.processed_tokens
        for got_row, want_row in zip(got.supports or (), want.supports or (), strict=True):  # the entries sent
            assert (got_row is None) == (want_row is None)
            if got_row is None or want_row is None:
                continue
            assert torch.equal(got_row.ids, want_row.ids)
            torch.testing.assert_close(got_row.values, want_row.values, **PROB_TOLERANCE)


def assert_same_sessions(left: DraftRunner, right: DraftRunner) -> None:
    assert sorted(left.sessions.ids()) == sorted(right.sessions.ids())  # recency order may differ by wave
    for session_id in left.sessions.ids():
        a, b = left.sessions._sessions[session_id], right.sessions._sessions[session_id]
        assert a.tokens == b.tokens and a.cached_tokens == b.cached_tokens
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [0, 16], ids=["full", "top16"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_proposals_equal_lone_ones_over_mixed_pasts_runs_and_k(loaded, params, top_k):
    """Sampled rows cut to the draft's top-k are drawn together too, each row cut alone."""
    lone, batched = make_runner(loaded, top_k=top_k), make_runner(loaded, top_k=top_k)
    vocab = loaded.vocab_size
    prompts = {f"s{i}": tokens(i, 4 + 5 * i, vocab) for i in range(4)}
    first = [
        ProposeCall(sid, 0, prompt, 2 + i % 3, params, seed=i, runner_ups=1 + i % 3)
        for i, (sid, prompt) in enumerate(prompts.items())
    ]
    assert_same(batched.propose_batch(first), alone(lone, first))
    assert_same_sessions(batched, lone)
    # Next rounds: each keeps part of its drafts, appends 1-3 committed tokens, asks a different K.
    second = [
        ProposeCall("s0", len(prompts["s0"]) + 1, [7], 4, params, seed=10),
        ProposeCall("s1", len(prompts["s1"]), [8, 9], 1, params, seed=11),
        ProposeCall("s2", len(prompts["s2"]) + 2, [3, 4, 5], 3, params, seed=12),
        ProposeCall("s3", len(prompts["s3"]), [6], 5, params, seed=13),
        ProposeCall("p", 0, tokens(99, 60, vocab), 3, params, seed=14),  # a prompt prefill gets a pass of its own
    ]
    results = batched.propose_batch(second)
    assert_same(results, alone(lone, second))
    assert_same_sessions(batched, lone)
    assert max(r.batch_size for r in results) >= 3
    assert batched.batched_forwards > 0


def test_each_call_is_answered_as_soon_as_its_own_drafts_are_done(loaded):
    """propose_batch's `answer` (CallBatcher, answers_early): a call of K = 1 is answered while
    the batch steps on for K = 5, each call once, with the proposal the batch returns for it."""
    runner = make_runner(loaded)
    vocab = loaded.vocab_size
    prompts = {f"s{i}": tokens(i, 5, vocab) for i in range(3)}
    for sid, prompt in prompts.items():
        runner.propose_one(ProposeCall(sid, 0, prompt, 1, GREEDY, 0))
    ks = {"s0": 5, "s1": 1, "s2": 3}
    calls = [ProposeCall(sid, len(prompts[sid]), [7], ks[sid], GREEDY, 0) for sid in prompts]
    answered: list[tuple[int, object, int]] = []  # (call, proposal, decode steps run by then)
    steps = [0]
    step = type(runner).decode_batch

    def counting_decode_batch(self, *args, **kwargs):
        batch, failures = step(self, *args, **kwargs)
        inner = batch.step

        def counted(tokens_in):
            steps[0] += 1
            return inner(tokens_in)

        batch.step = counted
        return batch, failures

    runner.decode_batch = counting_decode_batch.__get__(runner)
    results = runner.propose_batch(calls, lambda index, proposal: answered.append((index, proposal, steps[0])))
    assert [index for index, _, _ in answered] == [1, 2, 0]  # K = 1, then 3, then 5
    assert all(results[index] is proposal for index, proposal, _ in answered)
    assert [len(results[index].token_ids) for index, _, _ in answered] == [1, 3, 5]
    assert answered[0][2] < answered[-1][2]  # the K = 1 call was answered steps before the batch ended


def test_a_bad_call_fails_alone_and_a_session_called_twice_keeps_its_order(loaded):
    lone, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("a", 0, tokens(1, 6, vocab), 2, GREEDY, 0))
    calls = [
        ProposeCall("a", 7, [11], 3, GREEDY, 0),
        ProposeCall("ghost", 4, [1], 2, GREEDY, 0),  # unknown session keeping tokens
        ProposeCall("b", 0, [1, 2, 3], 99, GREEDY, 0),  # K over the limit
        ProposeCall("c", 0, tokens(2, 5, vocab), 2, GREEDY, 0),
        ProposeCall("a", 8, [12, 13], 2, GREEDY, 0),  # the same session again: after its first call
    ]
    results = batched.propose_batch(calls)
    assert isinstance(results[1], SessionNotFound) and isinstance(results[2], InvalidArgument)
    assert_same(results, alone(lone, calls))
    assert_same_sessions(batched, lone)


def test_a_cancelled_call_stops_after_its_current_step_while_the_others_go_on(loaded):
    runner = make_runner(loaded)
    vocab = loaded.vocab_size
    steps = {"n": 0}

    def stop_after_first() -> bool:
        steps["n"] += 1
        return True

    calls = [
        ProposeCall("stops", 0, tokens(3, 5, vocab), 6, GREEDY, 0, should_stop=stop_after_first),
        ProposeCall("goes", 0, tokens(4, 5, vocab), 6, GREEDY, 0),
    ]
    stopped, went = runner.propose_batch(calls)
    assert len(stopped.token_ids) == 1 and len(went.token_ids) == 6
    assert runner.stopped_proposals == 1


def test_a_prompt_whose_caller_left_stops_its_prefill_while_the_batchs_others_go_on(loaded):
    """A long prompt runs alone in a batch, its prefill cut in prefix-cache blocks: its own
    caller gone (cancelled), it stops at the next block, ending its session, and the batch's
    other call drafts on. (Only the job's every caller gone stopped it before: the prompt's
    whole prefill ran for no one while the others waited.)"""
    runner = DraftRunner(
        loaded, max_sessions=16, session_ttl_s=60, max_speculative_tokens=8, prefix_cache_bytes=1 << 24
    )
    runner.sessions.prefix.block_tokens = 8
    vocab, passes = loaded.vocab_size, []
    plain = runner._forward_admitted

    def counted(session, token_ids, logits_to_keep):
        passes.append(session.session_id)
        return plain(session, token_ids, logits_to_keep)

    runner._forward_admitted = counted  # type: ignore[method-assign]
    calls = [
        ProposeCall("long", 0, tokens(6, 12 * 8 + 3, vocab), 3, GREEDY, 0, should_stop=lambda: len(passes) >= 2),
        ProposeCall("goes", 0, tokens(7, 3, vocab), 3, GREEDY, 0),
    ]
    stopped, went = runner.propose_batch(calls)
    assert isinstance(stopped, JobGivenUp) and stopped.code == grpc.StatusCode.CANCELLED
    assert passes.count("long") <= 3, f"{passes.count('long')} passes: the prefill ran on for no one"
    assert len(went.token_ids) == 3 and runner.sessions.ids() == ["goes"]


def test_a_fork_waits_for_its_parents_call_in_the_same_batch(loaded):
    lone, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    prompt = tokens(5, 8, vocab)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("parent", 0, prompt, 2, GREEDY, 0, epoch=1))
    calls = [
        ProposeCall("parent", len(prompt) + 1, [9], 3, GREEDY, 0, epoch=2),  # the pre-draft
        ProposeCall("branch", len(prompt), [10], 3, GREEDY, 0, epoch=3, fork_from="parent"),  # a hedge
        ProposeCall("other", 0, tokens(6, 4, vocab), 3, GREEDY, 0),
    ]
    assert_same(batched.propose_batch(calls), alone(lone, calls))
    assert_same_sessions(batched, lone)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_forks_listed_before_their_parents_call_share_its_passes_and_copy_it_as_it_was(loaded, params):
    """The coordinator's ProposeBranches: hedges fork the session, then the pre-draft extends it,
    all in one wave. Each fork must see the parent before the pre-draft, as if run alone first."""
    lone, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    prompt = tokens(7, 9, vocab)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("parent", 0, prompt, 3, params, 0, epoch=1))
    held = len(prompt) + 3  # the prompt and the round's drafts
    calls = [
        ProposeCall("hedge0", len(prompt), [11], 3, params, seed=1, epoch=2, fork_from="parent"),
        ProposeCall("hedge1", len(prompt) + 1, [12], 3, params, seed=2, epoch=3, fork_from="parent"),
        ProposeCall("parent", held, [], 4, params, seed=3, epoch=4),  # the pre-draft: bonus guess + 3
    ]
    results = batched.propose_batch(calls)
    assert_same(results, alone(lone, calls))
    assert_same_sessions(batched, lone)
    assert [r.batch_size for r in results] == [3, 3, 3], "the branches did not share their passes"
    assert batched.sessions._sessions["hedge0"].tokens[: len(prompt) + 1] == prompt + [11]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_forks_guessing_the_bonus_by_runner_ups_share_the_pre_drafts_passes(loaded, params):
    """--bonus-guesses: forks of the session as the round left it guess the bonus token by the
    draft's runner-ups (guess_rank), in the pre-draft's passes; each guess is the draft's
    token of that rank, sent one-hot, and the drafts after it are drawn as usual."""
    lone, batched = make_runner(loaded), make_runner(loaded)
    prompt = tokens(5, 9, loaded.vocab_size)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("parent", 0, prompt, 3, params, 0, epoch=1, runner_ups=3))
    held = len(prompt) + 3
    calls = [
        *(
            ProposeCall(
                f"guess{rank}",
                held,
                [],
                3,
                params,
                seed=rank,
                epoch=1 + rank,
                fork_from="parent",
                guess_first=True,
                guess_rank=rank,
            )
            for rank in (1, 2)
        ),
        ProposeCall("parent", held, [], 3, params, seed=3, epoch=4, guess_first=True, runner_ups=3),
    ]
    results = batched.propose_batch(calls)
    assert_same(results, alone(lone, calls))
    assert_same_sessions(batched, lone)
    assert [r.batch_size for r in results] == [3, 3, 3], "the guesses did not share their passes"
    pre_draft = results[-1]
    # The pre-draft's guess is the argmax; its runner-ups at that position are the forks' guesses.
    assert [r.token_ids[0] for r in results[:2]] == pre_draft.runner_up_ids[:2]
    for result in results:
        assert result.probs[0].max() == 1.0 and result.probs[0][result.token_ids[0]] == 1.0  # one-hot guess
    # Info counts the forks no call has continued since (ModelInfo.fork_sessions): a caller
    # counting the draft's load in requests leaves them out. A branch taken is one no more.
    assert batched.describe().fork_sessions == 2 and batched.describe().open_sessions == 3
    batched.propose_one(ProposeCall("guess1", held + 3, [], 2, params, seed=5, epoch=9))  # its guess and 2 drafts kept
    assert batched.describe().fork_sessions == 1


def test_a_runner_up_guess_does_not_stop_its_fork_on_confidence(loaded):
    """Issue 65: a fork guessing a runner-up for the bonus token would stop at its guess under
    the default --min-confidence 0.4 (a runner-up is below 0.5), leaving no draft past it to
    keep. Its guess's own probability no longer stops it; the drafts after it stop on theirs."""
    runner = DraftRunner(loaded, 16, 60, 8, proposal_top_k=0, min_confidence=0.4)
    prompt = tokens(5, 9, loaded.vocab_size)
    runner.propose_one(ProposeCall("parent", 0, prompt, 1, GREEDY, 0))
    held = len(prompt) + 1
    fork = ProposeCall("fork", held, [], 3, GREEDY, 0, epoch=2, fork_from="parent", guess_first=True, guess_rank=1)
    guessed = runner.propose_one(fork)
    pre_draft = runner.propose_one(ProposeCall("parent", held, [], 3, GREEDY, 0, epoch=3, guess_first=True))
    assert guessed.token_ids[0] == pre_draft.runner_up_ids[0] and pre_draft.runner_up_probs[0] < 0.4
    assert len(guessed.token_ids) > 1, "the fork stopped at its guess"


def test_one_token_steps_share_one_batch_padded_and_split_once(loaded):
    """After their first pass, calls whose steps are one token each run in one DecodeBatch:
    calls of different K stop at different passes, and each session is left with exactly
    its own entries (compared with lone runs, entry by entry)."""
    lone, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    prompt = tokens(8, 12, vocab)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("parent", 0, prompt, 6, GREEDY, 0, epoch=1))
    calls = [
        ProposeCall(f"hedge{j}", len(prompt) + j, [20 + j], 2 + j, GREEDY, 0, epoch=2, fork_from="parent", runner_ups=3)
        for j in range(5)
    ]
    passes = batched.batched_forwards
    results = batched.propose_batch(calls)
    assert_same(results, alone(lone, calls))
    assert_same_sessions(batched, lone)
    # Every fork's first step is its one new token: one pass for each of the longest call's 6 steps.
    assert batched.batched_forwards - passes == 6
    assert [r.batch_size for r in results] == [5] * 5


def test_a_failed_pass_of_a_decode_batch_fails_and_ends_every_session_in_it(loaded, monkeypatch):
    runner = make_runner(loaded)
    vocab = loaded.vocab_size
    runner.propose_one(ProposeCall("parent", 0, tokens(9, 10, vocab), 2, GREEDY, 0, epoch=1))
    forward = runner.model.forward

    def failing(*args, **kwargs):
        if kwargs["input_ids"].shape == (3, 1) and runner.batched_forwards >= 1:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", failing)
    calls = [ProposeCall(f"b{j}", 10 + j, [30 + j], 4, GREEDY, 0, epoch=2, fork_from="parent") for j in range(3)]
    results = runner.propose_batch(calls)
    assert all(isinstance(result, RuntimeError) for result in results)
    assert all(runner.sessions.peek(f"b{j}") is None for j in range(3))
    assert runner.sessions.peek("parent") is not None  # not in the batch


def count_own_passes(runner: DraftRunner) -> list[int]:
    """Records the size of each pass the runner runs outside a decode batch (`forward_batch`)."""
    sizes: list[int] = []
    forward_batch = runner.forward_batch

    def counted(sessions, *args, **kwargs):
        sizes.append(len(sessions))
        return forward_batch(sessions, *args, **kwargs)

    runner.forward_batch = counted  # type: ignore[method-assign]
    return sizes


def joining(waves: list[list[ProposeCall]]):
    """A `join` for propose_batch (CallBatcher, joins) handing over waves[i] at its i-th call,
    and recording the `held` each call saw."""
    held: list[int] = []

    def join(now_held: int) -> list[ProposeCall]:
        held.append(now_held)
        return waves[len(held) - 1] if len(held) <= len(waves) else []

    return join, held


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_calls_that_join_a_running_batch_between_passes_equal_lone_ones(loaded, params, static):
    """Iteration-level batching: calls handed over by `join` while a batch steps enter it
    between passes, each with a round's committed tokens or a short prompt (a row with no
    past; both run in the batch's next pass beside the others' one token) or a long prompt (a
    pass of its own first). Pasts longer and shorter
    than the batch's width; each call's proposal and every session's entries are what lone
    calls in the same order give, and every call is answered once."""
    lone, batched = make_runner(loaded), make_runner(loaded, static)
    vocab = loaded.vocab_size
    prompts = {"s0": tokens(20, 6, vocab), "s1": tokens(21, 9, vocab), "s2": tokens(22, 30, vocab)}
    prompts["s3"] = tokens(23, 3, vocab)
    for runner in (lone, batched):
        for sid, prompt in prompts.items():
            runner.propose_one(ProposeCall(sid, 0, prompt, 2, params, seed=1))
    first = [
        ProposeCall("s0", len(prompts["s0"]) + 1, [7], 6, params, seed=2),
        ProposeCall("s1", len(prompts["s1"]), [8, 9], 4, params, seed=3),
    ]
    joined = [
        [ProposeCall("s2", len(prompts["s2"]) + 2, [3, 4, 5], 3, params, seed=4)],  # longer past, 3 tokens
        [ProposeCall("q", 0, tokens(25, 4, vocab), 3, params, seed=7)],  # a short prompt: no past
        [
            ProposeCall("s3", len(prompts["s3"]) + 1, [6, 7], 5, params, seed=5),  # shorter past
            ProposeCall("p", 0, tokens(24, 40, vocab), 2, params, seed=6),  # a long prompt: a pass of its own
        ],
    ]
    join, held = joining(joined)
    answered: list[int] = []
    own = count_own_passes(batched)
    results = batched.propose_batch(first, lambda index, result: answered.append(index), join)
    everything = first + [call for wave in joined for call in wave]
    assert len(results) == len(everything) and sorted(answered) == list(range(len(everything)))
    assert_same(results, alone(lone, everything))
    assert_same_sessions(batched, lone)
    assert held[:3] == [2, 3, 4]  # the batch held s0 and s1, then s2, then q too
    assert min(result.batch_size for result in results[2:]) >= 3, "the joined calls did not share passes"
    assert own == [1], "only the long prompt had a pass of its own"
    assert not static or any(bucket.sessions >= 4 for bucket in batched.static._passes), "no static batched step"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_batch_of_short_prompts_starts_with_no_cache_and_takes_more_as_they_come(loaded, params, static):
    """New sessions' prompts (at most a round's tokens) start a decode batch with nothing
    cached, so the first pass makes its cache; a prompt joining later is a row of pads up to
    the batch's width. Every proposal and session equals lone calls', and no call ran a pass
    outside the batch."""
    lone, batched = make_runner(loaded), make_runner(loaded, static)
    vocab = loaded.vocab_size
    first = [ProposeCall(f"n{i}", 0, tokens(40 + i, 2 + i, vocab), 4 + i, params, seed=i) for i in range(3)]
    joined = [[], [ProposeCall("late", 0, tokens(50, 5, vocab), 3, params, seed=9)]]
    join, held = joining(joined)
    own = count_own_passes(batched)
    results = batched.propose_batch(first, None, join)
    assert_same(results, alone(lone, first + joined[1]))
    assert_same_sessions(batched, lone)
    assert own == [] and held[:2] == [3, 3]
    assert not static or any(bucket.sessions >= 4 for bucket in batched.static._passes), "no static batched step"
    assert min(result.batch_size for result in results) >= 3, "the prompts did not share passes"


def test_a_call_on_a_session_still_drafting_runs_after_the_batch_which_takes_no_more(loaded):
    """A joined call on a session whose call is still in the batch waits for the batch to
    end (its sequence goes on from that call's); from then on the batch takes no more calls,
    so it ends within its calls' K passes. The batch after it takes calls again."""
    lone, batched = make_runner(loaded), make_runner(loaded)
    prompt = tokens(30, 8, loaded.vocab_size)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("a", 0, prompt, 2, GREEDY, 0, epoch=1))
        runner.propose_one(ProposeCall("b", 0, prompt[:5], 2, GREEDY, 0, epoch=1))
    first = [ProposeCall("a", len(prompt) + 1, [5], 4, GREEDY, 0, epoch=2)]
    again = ProposeCall("a", len(prompt) + 3, [6], 2, GREEDY, 0, epoch=3)  # after the call above
    other = ProposeCall("b", 6, [9], 2, GREEDY, 0, epoch=2)
    answered: list[int] = []
    join, held = joining([[again], [other]])
    joins_seen: list[list[int]] = []  # what was answered by each join

    def watched(now_held: int) -> list[ProposeCall]:
        joins_seen.append(list(answered))
        return join(now_held)

    results = batched.propose_batch(first, lambda index, result: answered.append(index), watched)
    assert joins_seen[:2] == [[], [0]]  # no join between `again` and the end of the first batch
    assert held[:2] == [1, 1] and len(results) == 3
    assert_same(results, alone(lone, [*first, again, other]))
    assert_same_sessions(batched, lone)


def test_a_static_decode_batch_that_outgrows_its_passes_goes_on_padded(loaded):
    """A decode batch stepping as static passes, joined by a session past what one takes,
    pads every session in and goes on as the eager batch does: the same logits, the same
    entries left in each session, and the same bytes counted against the KV budget (a static
    step's entries are in the sessions' own caches, no longer in the batch's reservation)."""
    vocab = loaded.vocab_size
    eager, static = make_runner(loaded), make_runner(loaded, static=True)
    assert static.static is not None
    static.static.max_sessions = 2  # three sessions: more than a static pass takes
    steps = [
        {"a": tokens(60, 3, vocab), "b": tokens(61, 5, vocab)},
        {"a": [4], "b": [5]},
        {"a": [6], "b": [7], "c": tokens(62, 4, vocab)},  # c joins: padded from here on
        {"a": [8], "b": [9], "c": [10]},
    ]
    logits: dict = {}
    counted: dict = {}  # what the KV budget counts: entries held, and what the batch's sessions are held for
    for runner in (eager, static):
        sessions = {sid: runner.sessions.open(sid, 0) for sid in "abc"}
        batch, failures = runner.decode_batch([sessions["a"], sessions["b"]], [6, 6])
        assert failures == [None, None]
        for index, feeds in enumerate(steps):
            if "c" in feeds and index == 2:
                assert batch.join(sessions["c"], 5) is None
            for sid, fed in feeds.items():
                sessions[sid].tokens.extend(fed)
            logits[runner, index] = batch.step(feeds)
            counted[runner, index] = runner.sessions.kv_bytes() + sum(runner.sessions._held.values())
        batch.close()
    assert [counted[static, i] for i in range(len(steps))] == [counted[eager, i] for i in range(len(steps))]
    for index in range(len(steps)):
        for sid, row in logits[eager, index].items():
            torch.testing.assert_close(logits[static, index][sid], row, **PROB_TOLERANCE)
    assert_same_sessions(static, eager)
    assert {(b.sessions, b.tokens) for b in static.static._passes} == {(2, 5), (2, 1)}  # the two static steps


def test_a_session_that_outgrew_its_reserved_room_fails_alone_loudly_and_is_ended(loaded, monkeypatch):
    """Joining a decode batch reserves each session's room for every token its call may run,
    so handing the cache back never needs more of the pool. If it ever did (a bug), that call
    fails with INTERNAL and its session is ended (its cache lacks the batch's entries); the
    other calls finish as they would alone and no other session is evicted for it."""
    lone, batched = make_runner(loaded), make_runner(loaded)
    vocab = loaded.vocab_size
    prompt = tokens(8, 12, vocab)
    for runner in (lone, batched):
        runner.propose_one(ProposeCall("parent", 0, prompt, 4, GREEDY, 0, epoch=1))
    calls = [
        ProposeCall(f"hedge{j}", len(prompt) + j, [20 + j], 2 + j, GREEDY, 0, epoch=2, fork_from="parent")
        for j in range(3)
    ]
    reserved = PoolCache.reserved_tokens

    def lost_for_hedge1(self):
        hedge1 = batched.sessions.peek("hedge1")
        return 1 if hedge1 is not None and self is hedge1.cache else reserved.fget(self)

    monkeypatch.setattr(PoolCache, "reserved_tokens", property(lost_for_hedge1))
    passes = batched.batched_forwards
    results = batched.propose_batch(calls)
    assert batched.batched_forwards - passes == 4  # the batch ran on: the failure came as hedge1 left it
    assert isinstance(results[1], SpecDecError) and results[1].code == grpc.StatusCode.INTERNAL
    assert "more than the 1 its join reserved" in str(results[1])
    assert batched.sessions.peek("hedge1") is None and batched.sessions.evicted == 0
    assert_same([results[0], results[2]], alone(lone, [calls[0], calls[2]]))
    for session_id in ("parent", "hedge0", "hedge2"):
        a, b = batched.sessions.peek(session_id), lone.sessions.peek(session_id)
        assert a.tokens == b.tokens and a.cached_tokens == b.cached_tokens
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def int8_loaded(tiny_pair):
    """The tiny draft as the service runs an int8 draft on CPU: per-token Linear layers,
    attention row by row (draft_service.server)."""
    from draft_service.server import int8_on_cpu

    return int8_on_cpu(load_causal_lm(str(tiny_pair.draft), "float32", "cpu"))


def assert_bitwise(batched: list, lone: list) -> None:
    for got, want in zip(batched, lone, strict=True):
        assert got.token_ids == want.token_ids
        assert torch.equal(got.probs, want.probs) and got.runner_up_ids == want.runner_up_ids
        assert got.runner_up_probs == want.runner_up_probs


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_an_int8_drafts_batched_proposals_are_bitwise_its_lone_ones(int8_loaded, params):
    """A soak on the real pair: a seeded sampled request's text changed with other requests on
    the draft (4 of 6 under 4 users; n = 2's choice 0 never the n = 1 output): the int8 draft's
    batched passes differed from its lone ones by up to 0.044 in total variation, a padded
    SDPA pass's rounding made whole quantisation steps by its per-token int8 layers. Rows read
    their own keys as a lone pass does, as the int8 target's do."""
    lone, batched = make_runner(int8_loaded), make_runner(int8_loaded)
    vocab = int8_loaded.vocab_size
    prompts = {f"s{i}": tokens(i, 4 + 5 * i, vocab) for i in range(4)}
    first = [
        ProposeCall(sid, 0, prompt, 3 + i % 3, params, seed=i, runner_ups=1 + i % 2)
        for i, (sid, prompt) in enumerate(prompts.items())
    ]
    # Prompts longer than MAX_ROWS run alone, under SDPA, batched or not: so does this pair's.
    first += [ProposeCall(f"long{i}", 0, tokens(50 + i, 100 - 9 * i, vocab), 3, params, seed=20 + i) for i in range(2)]
    assert_bitwise(batched.propose_batch(first), alone(lone, first))
    second = [
        ProposeCall("s0", len(prompts["s0"]) + 1, [7], 4, params, seed=10),
        ProposeCall("s1", len(prompts["s1"]), [8, 9], 2, params, seed=11),
        ProposeCall("s2", len(prompts["s2"]) + 2, [3, 4, 5], 3, params, seed=12),
        ProposeCall("s3", len(prompts["s3"]), [6], 5, params, seed=13),
    ]
    results = batched.propose_batch(second)
    assert_bitwise(results, alone(lone, second))
    assert max(r.batch_size for r in results) >= 3


@pytest.mark.parametrize("top_k", [0, 16], ids=["full", "top16"])
def test_a_nan_row_in_a_sampled_step_leaves_the_other_rows_drawn_as_alone(loaded, top_k):
    """Rows drawn together are drawn before the one transfer says whether every row is finite;
    a NaN row puts every generator back and each row steps alone: the finite rows draw what
    they draw alone, their generators where alone leaves them, and the NaN row fails alone."""
    vocab, params = loaded.vocab_size, SamplingParams(temperature=0.9)
    generator = torch.Generator().manual_seed(3)
    logits = [torch.randn(vocab, generator=generator) * 3 for _ in range(3)]  # [V] each
    logits[1][7] = float("nan")

    def begun(runner: DraftRunner) -> list:
        return [runner._begin(ProposeCall(f"nan{i}", 0, tokens(i, 8, vocab), 4, params, seed=10 + i)) for i in range(3)]

    together_runner, lone_runner = make_runner(loaded, top_k=top_k), make_runner(loaded, top_k=top_k)
    together, lone, results = begun(together_runner), begun(lone_runner), [None] * 3
    step_all(
        together_runner, [(i, drafting, row) for i, (drafting, row) in enumerate(zip(together, logits))], 3, results
    )
    for i in (0, 2):
        lone_runner._step(lone[i], logits[i], 1)
    assert isinstance(results[1], ModelOutputError) and results[0] is None and results[2] is None
    for i in (0, 2):
        assert together[i].token_ids == lone[i].token_ids
        assert together[i].generator.bit_generator.state == lone[i].generator.bit_generator.state
