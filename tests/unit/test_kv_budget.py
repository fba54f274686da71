"""The KV byte budget: least recently used sessions are evicted to make room, a session that
cannot fit alone is refused with the numbers, and Info reports the memory."""

from __future__ import annotations

import gc

import pytest
import torch

from draft_service.drafter import ProposeCall
from draft_service.ngram import NgramDrafter
from draft_service.runner import DraftRunner
from specdec.config.services import parse_bytes, parse_kv_budget
from specdec.engine import memory
from specdec.engine.kv_pool import PAGE_TOKENS, KVPool, kv_geometry
from specdec.engine.memory import MemoryShare, kv_budget
from specdec.engine.modeling import load_causal_lm, load_tokenizer_info
from specdec.engine.runner import kv_bytes_per_token
from specdec.errors import InvalidArgument, ResourceExhausted, SessionNotFound
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    return load_causal_lm(str(tiny_pair.target), "float32", "cpu")


def verify(runner, session_id, keep, new_tokens):
    return runner.verify_one(
        VerifyCall(session_id, keep, new_tokens, [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0)
    )


def test_bytes_per_token_is_what_the_cache_really_holds(loaded):
    runner = TargetRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    verify(runner, "m", 0, list(range(1, 31)))
    session = runner.sessions.open("m", 1)
    assert session.kv_bytes == session.cached_tokens * runner.kv_bytes_per_token > 0
    info = runner.describe()
    assert (info.kv_cache_bytes, info.kv_bytes_per_token, info.max_kv_cache_bytes) == (
        session.kv_bytes,
        runner.kv_bytes_per_token,
        0,
    )


def test_least_recently_used_sessions_are_evicted_to_fit_the_budget(loaded):
    per_token = TargetRunner(loaded, 1, 60, 4).kv_bytes_per_token
    runner = TargetRunner(
        loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=70 * per_token
    )
    verify(runner, "old", 0, list(range(1, 31)))  # 30 tokens
    verify(runner, "recent", 0, list(range(1, 31)))  # 60 in all
    verify(runner, "recent", 30, [5])  # "recent" is now the most recently used
    verify(runner, "new", 0, list(range(1, 21)))  # 81 > 70: the least recently used goes
    assert runner.sessions.evicted == 1
    with pytest.raises(SessionNotFound):
        verify(runner, "old", 30, [5])
    verify(runner, "recent", 31, [6])  # still held
    info = runner.describe()
    assert info.kv_cache_bytes <= info.max_kv_cache_bytes == 70 * per_token and info.evicted_sessions == 1


def test_a_decode_batch_s_sessions_count_what_they_may_add_and_are_never_evicted(loaded):
    """While a decode batch runs, its sessions' entries sit in the batch and the store holds
    none of them: a call beside it is admitted against what the batch may still add, and the
    batch's sessions are never evicted for it (their pages stay with the batch), so an idle
    session goes and the budget holds when the batch hands the caches back."""
    per = kv_bytes_per_token(loaded.model)
    runner = TargetRunner(loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=100 * per)

    def opened(session_id: str, tokens: int):
        session = runner.sessions.open(session_id, 0)
        return session, session.extend(0, [1 + i % 10 for i in range(tokens)])

    idle, prompt = opened("idle", 30)  # beside the batch's 64, within the budget
    runner.forward(idle, prompt, 1)
    (a, feed_a), (b, feed_b) = opened("a", 30), opened("b", 30)
    batch, failures = runner.decode_batch([a, b], [32, 32])
    assert failures == [None, None]
    batch.step({"a": feed_a, "b": feed_b})
    beside, prompt = opened("beside", 20)
    runner.forward(beside, prompt, 1)  # 30 idle + 20 + what a and b may reach (64): over 100
    assert runner.sessions.ids() == ["a", "b", "beside"] and runner.sessions.evicted == 1
    batch.step({"a": [3], "b": [4]})
    batch.close()
    assert runner.sessions.kv_bytes() <= 100 * per


def call(runner, session_id, keep, new_tokens) -> VerifyCall:
    return VerifyCall(session_id, keep, new_tokens, [], torch.zeros(0, runner.loaded.vocab_size), GREEDY, 0)


def tiny_pool(runner, pages: int) -> None:
    """A pool of `pages` 64-token pages in place of the runner's, before any session opens: as
    tight as a CUDA pool sized to its budget and a page a session."""
    layers, heads, dim = kv_geometry(runner.model.config)
    runner.pool = KVPool(layers, heads, dim, pages=pages, dtype=runner.model.dtype)


def test_a_batched_verify_never_evicts_a_session_of_its_own_pass(loaded):
    """Three sessions near the budget verify together: admitting one must not evict another
    of the same pass (its pass keeps its entries; evicting it frees nothing, undercounts the
    KV held, and loses a session whose call just succeeded). The budget is exceeded by the
    pass's own growth, as a batch of calls admitted together may."""
    per = kv_bytes_per_token(loaded.model)
    runner = TargetRunner(loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=92 * per)
    for session_id in "abc":
        verify(runner, session_id, 0, [1 + (ord(session_id) + i) % 40 for i in range(30)])
    results = runner.verify_batch([call(runner, session_id, 30, [5, 6, 7, 8]) for session_id in "abc"])
    assert not any(isinstance(result, Exception) for result in results)
    assert runner.sessions.evicted == 0 and runner.sessions.ids() == ["a", "b", "c"]
    verify(runner, "b", 34, [9])  # still held


def test_a_full_pool_refuses_the_call_that_does_not_fit_without_evicting_its_batch(loaded):
    """Every page taken by the sessions of one batched verify: the one that must move to grow
    is refused alone; the others are neither evicted for it nor lost."""
    runner = TargetRunner(loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4)
    tiny_pool(runner, 4)
    for session_id in "abc":  # a page each, next to each other; one page free after c
        verify(runner, session_id, 0, [1 + (ord(session_id) + i) % 40 for i in range(60)])
    results = runner.verify_batch([call(runner, session_id, 60, [5, 6, 7, 8, 9, 10]) for session_id in "abc"])
    assert isinstance(results[0], ResourceExhausted) and isinstance(results[1], ResourceExhausted)
    assert not isinstance(results[2], Exception)  # c grows into the free page
    assert runner.sessions.evicted == 0 and runner.sessions.ids() == ["c"]  # a and b failed and were ended
    verify(runner, "c", 66, [9])


def test_a_draft_call_opening_a_session_evicts_no_session_of_its_wave(loaded):
    """A batch of Propose calls: opening a new session where the pool is full evicts the least
    recently used session outside the batch, not one whose call runs in it."""
    runner = DraftRunner(loaded, 8, 60, 8, proposal_top_k=0)
    tiny_pool(runner, 3)
    prompt = list(range(3, 13))
    for session_id in ("b", "a", "idle"):  # b is the least recently used
        runner.propose_one(ProposeCall(session_id, 0, prompt, 2, GREEDY, seed=0))
    runner.propose_one(ProposeCall("a", 12, [5], 2, GREEDY, seed=0))  # "idle" is now older than "a"
    calls = [ProposeCall("new", 0, prompt, 2, GREEDY, seed=0), ProposeCall("b", 12, [5], 2, GREEDY, seed=0)]
    results = runner.propose_batch(calls)
    assert not any(isinstance(result, Exception) for result in results), results
    assert runner.sessions.evicted == 1 and sorted(runner.sessions.ids()) == ["a", "b", "new"]


def test_a_decode_batch_admitting_its_first_call_evicts_no_later_call_of_its_wave(loaded):
    """The calls of one wave go into a decode batch one by one: making room for the first
    must not evict the session of a later one (it would run anyway, and its next call get
    NOT_FOUND): the batch runs over the budget by its own growth instead."""
    per = kv_bytes_per_token(loaded.model)
    runner = DraftRunner(loaded, 8, 60, 8, proposal_top_k=0, max_kv_bytes=100 * per)
    for session_id, start in (("a", 1), ("b", 20)):
        runner.propose_one(ProposeCall(session_id, 0, list(range(start, start + 49)), 1, GREEDY, seed=0))
    results = runner.propose_batch([ProposeCall(sid, 49, [5], 6, GREEDY, seed=0) for sid in ("a", "b")])
    assert not any(isinstance(result, Exception) for result in results), results
    assert runner.sessions.evicted == 0 and sorted(runner.sessions.ids()) == ["a", "b"]
    runner.propose_one(ProposeCall("b", 56, [6], 2, GREEDY, seed=0))  # still held


def test_a_refused_call_leaves_no_session_behind(loaded, tiny_pair):
    """A call refused for a negative keep_tokens or an empty sequence opened its session first,
    which then stayed until its TTL: --max-sessions such calls refused every new generation."""
    draft = DraftRunner(loaded, 2, 60, 8, proposal_top_k=0)
    target = TargetRunner(loaded, max_sessions=2, session_ttl_s=60, max_speculative_tokens=4)
    ngram = NgramDrafter(load_tokenizer_info(str(tiny_pair.target)), 2, 60, 8, min_n=1, max_n=3)
    bad_calls = [
        (draft.propose_one, ProposeCall("a", 0, [], 2, GREEDY, seed=0)),
        (draft.propose_one, ProposeCall("b", -1, [5], 2, GREEDY, seed=0)),
        (ngram.propose_one, ProposeCall("a", 0, [], 2, GREEDY, seed=0)),
        (ngram.propose_one, ProposeCall("b", -1, [5], 2, GREEDY, seed=0)),
        (target.verify_one, call(target, "a", -1, [5])),
        (target.verify_one, call(target, "b", 0, [])),
    ]
    for method, bad in bad_calls:
        with pytest.raises(InvalidArgument):
            method(bad)
    assert draft.sessions.ids() == ngram.sessions.ids() == target.sessions.ids() == []
    draft.propose_one(ProposeCall("good", 0, [5, 6], 2, GREEDY, seed=0))
    ngram.propose_one(ProposeCall("good", 0, [5, 6], 2, GREEDY, seed=0))
    verify(target, "good", 0, [5, 6])


def test_a_new_session_whose_prefix_hit_does_not_fit_the_pool_is_not_left_behind(loaded):
    """A new session starting from a cached prefix copies its blocks into pool pages; where
    none are free and the one other session shares its batch, the call is refused, and the
    session it opened, empty, is ended rather than held till its TTL."""
    runner = TargetRunner(
        loaded,
        max_sessions=8,
        session_ttl_s=60,
        max_speculative_tokens=4,
        prefix_cache_bytes=1 << 24,
        prefix_block_tokens=8,
    )
    tiny_pool(runner, 2)
    prompt = [(7 * i + 3) % 40 + 1 for i in range(100)]
    verify(runner, "first", 0, prompt)  # both pages
    assert runner.end_session("first")  # its 12 blocks (96 tokens) stay in the prefix cache
    verify(runner, "holder", 0, [1, 2, 3, 4, 5])  # a page
    before = runner.describe().prefix_cache  # (bytes, max, block, lookups, hits, tokens saved)
    results = runner.verify_batch([call(runner, "holder", 5, [6]), call(runner, "second", 0, [*prompt, 9])])
    assert not isinstance(results[0], Exception)
    assert isinstance(results[1], ResourceExhausted)  # the hit needs two pages; holder is spared
    assert runner.sessions.ids() == ["holder"]
    after = runner.describe().prefix_cache  # a lookup, but no hit and no tokens saved: nothing started from it
    assert after[3] == before[3] + 1 and after[4:] == before[4:], (before, after)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_session_evicted_after_it_left_a_decode_batch_frees_its_pages_for_the_call_joining(loaded, static):
    """Sessions "a" and "b" fill the pool (a page each; a static runner's scratch page is the third)
    and draft in one decode batch. "a" proposes one token and leaves it; "b" goes on. A new
    session's prompt joins: the least recently used session held by nothing is "a", whose
    eviction frees its page there and then, so the prompt drafts in the running batch, and
    only "a" pays, with a re-prefill."""
    runner, lone = DraftRunner(loaded, 8, 60, 8, proposal_top_k=0), DraftRunner(loaded, 8, 60, 8, proposal_top_k=0)
    tiny_pool(runner, 2 + static)
    if static:
        runner.max_batch_size = 4
        runner.use_static_passes("on")
    prompts = {"a": list(range(3, 13)), "b": list(range(4, 14))}
    for session_id, prompt in prompts.items():
        for each in (runner, lone):
            each.propose_one(ProposeCall(session_id, 0, prompt, 2, GREEDY, seed=1))
    assert runner.pool.allocator.free_pages == 0
    first = [
        ProposeCall("a", 11, [7], 1, GREEDY, seed=2),  # done after the batch's first pass
        ProposeCall("b", 11, [8], 6, GREEDY, seed=3),
    ]
    joined = ProposeCall("c", 0, [4, 5, 6, 9, 10], 3, GREEDY, seed=4)
    waves = [[], [joined]]  # it joins as "a" has left
    held: list[int] = []

    def join(now_held: int) -> list[ProposeCall]:
        held.append(now_held)
        return waves.pop(0) if waves else []

    results = runner.propose_batch(first, None, join)
    assert held[:2] == [2, 1]
    assert not [result for result in results if isinstance(result, Exception)], results
    assert [len(result.token_ids) for result in results] == [1, 6, 3]
    assert results[2].batch_size >= 2, "c did not join the running batch"
    for result, call in zip(results, [*first, joined]):  # "c" drafted in the page "a" held, none of it stale
        assert result.token_ids == lone.propose_one(call).token_ids
    assert runner.sessions.evicted == 1 and runner.sessions.ids() == ["b", "c"]
    with pytest.raises(SessionNotFound):  # "a" re-prefills: the eviction's cost, once
        runner.propose_one(ProposeCall("a", 12, [5], 2, GREEDY, seed=5))


@pytest.mark.parametrize("refused", ["growing", "prefilling"])
def test_a_call_refused_as_it_joins_a_decode_batch_leaves_its_pages_to_the_next(loaded, refused):
    """Sessions "a" and "b" draft in a decode batch, a page each, in a three-page pool. A call joins that
    does not fit: "c" (a page of its own, 60 tokens) can grow into no second page, or "d" (a
    new session, opened in the free page) cannot prefill its 70 tokens in one. It is refused
    and its session ended; a new session's prompt joining after it drafts in that page, in the
    same batch."""
    runner = DraftRunner(loaded, 8, 60, 8, proposal_top_k=0)
    tiny_pool(runner, 3)
    prompts = {"a": list(range(3, 13)), "b": list(range(4, 14)), "c": [(5 * i) % 50 + 2 for i in range(60)]}
    for session_id in "ab" if refused == "prefilling" else "abc":
        runner.propose_one(ProposeCall(session_id, 0, prompts[session_id], 2, GREEDY, seed=1))
    first = [ProposeCall(sid, len(prompts[sid]) + 1, [7], 8, GREEDY, seed=2) for sid in "ab"]
    if refused == "growing":
        misfit = ProposeCall("c", len(prompts["c"]) + 1, [8], 8, GREEDY, seed=3)
    else:
        misfit = ProposeCall("d", 0, [(3 * i) % 40 + 1 for i in range(70)], 2, GREEDY, seed=3)
    waves = [[], [misfit], [ProposeCall("e", 0, [4, 5, 6], 3, GREEDY, seed=4)]]
    results = runner.propose_batch(first, None, lambda held: waves.pop(0) if waves else [])
    assert isinstance(results[2], ResourceExhausted) and misfit.session_id not in runner.sessions.ids()
    assert not isinstance(results[3], Exception), results[3]
    assert results[3].batch_size >= 2, "e did not join the running batch"
    assert sorted(runner.sessions.ids()) == ["a", "b", "e"] and runner.sessions.evicted == 0


@pytest.mark.parametrize("runner_kind", ["target", "draft"])
def test_a_call_refused_in_a_batch_gives_its_pages_back_without_the_cyclic_collector(loaded, runner_kind):
    """A batch of two calls in a two-page pool: "h" (a page) and a new session whose 70-token
    prompt needs two. The prompt is refused and its session ended; once the results are
    dropped its page is free, with the cyclic collector off."""
    long, short = [(3 * i) % 40 + 1 for i in range(70)], [1, 2, 3, 4, 5]
    gc.disable()
    try:
        if runner_kind == "target":
            runner = TargetRunner(loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4)
            tiny_pool(runner, 2)
            runner.verify_one(call(runner, "h", 0, short))
            results = runner.verify_batch([call(runner, "h", 5, [6]), call(runner, "x", 0, long)])
        else:
            runner = DraftRunner(loaded, 8, 60, 8, proposal_top_k=0)
            tiny_pool(runner, 2)
            runner.propose_one(ProposeCall("h", 0, short, 2, GREEDY, seed=0))
            calls = [ProposeCall("h", 6, [6], 2, GREEDY, seed=0), ProposeCall("x", 0, long, 2, GREEDY, seed=0)]
            results = runner.propose_batch(calls)
        assert not isinstance(results[0], Exception) and isinstance(results[1], ResourceExhausted)
        del results
        assert runner.sessions.ids() == ["h"] and runner.pool.allocator.free_pages == 1
    finally:
        gc.enable()


def test_a_session_that_cannot_fit_alone_is_refused_with_the_numbers(loaded):
    per_token = TargetRunner(loaded, 1, 60, 4).kv_bytes_per_token
    runner = TargetRunner(
        loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=10 * per_token
    )
    verify(runner, "other", 0, [1, 2, 3])
    with pytest.raises(ResourceExhausted) as refused:
        verify(runner, "big", 0, list(range(1, 21)))
    message = str(refused.value)
    assert f"{20 * per_token} bytes" in message and "(20 tokens" in message and f"is {10 * per_token} bytes" in message
    assert "--max-kv-bytes" in message
    assert runner.sessions.evicted == 0, "a request that cannot fit must not evict others for nothing"
    with pytest.raises(SessionNotFound):
        verify(runner, "big", 20, [5])  # nothing half-made is kept
    verify(runner, "other", 3, [4])  # the service keeps serving


def test_sizes_parse_with_units():
    assert parse_bytes("1048576") == 2**20
    assert (
        parse_bytes("512MiB") == 512 * 2**20
        and parse_bytes("8GiB") == 8 * 2**30
        and parse_bytes("1.5GB") == 1_500_000_000
    )
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_a_share_of_memory_parses_and_becomes_bytes_of_what_is_available(loaded, monkeypatch):
    """--max-kv-bytes 25%: a quarter of the memory available at start-up, less each session's
    first page, so that the pool it sizes takes the quarter (on CUDA; on CPU twice the budget,
    committed only as written)."""
    assert parse_kv_budget("25%") == MemoryShare(0.25) and parse_kv_budget(" 90.5% ") == MemoryShare(0.905)
    assert parse_kv_budget("8GiB") == 8 * 2**30
    for bad in ("0%", "101%", "many%"):
        with pytest.raises(ValueError, match="share of memory"):
            parse_kv_budget(bad)
    per_token = TargetRunner(loaded, 1, 60, 4).kv_bytes_per_token
    available = 10_000 * per_token
    monkeypatch.setattr(memory, "available_bytes", lambda device: available)
    pages = 8 * PAGE_TOKENS * per_token
    assert kv_budget(MemoryShare(0.25), per_token, 8, "cpu") == available // 4 - pages
    assert kv_budget(4096, per_token, 8, "cpu") == 4096  # a size stays as it is
    runner = TargetRunner(
        loaded, max_sessions=8, session_ttl_s=60, max_speculative_tokens=4, max_kv_bytes=MemoryShare(0.25)
    )
    assert runner.describe().max_kv_cache_bytes == available // 4 - pages
    verify(runner, "a", 0, [1, 2, 3])  # serves within it
    with pytest.raises(ValueError, match=r"--max-kv-bytes 1% of .* leaves room for 0 tokens"):
        kv_budget(MemoryShare(0.01), per_token, 8, "cpu")  # less than the sessions' first pages
    # The prefix cache counts in the budget: as a size's config refuses a larger one, so does a share.
    with pytest.raises(ValueError, match=r"--prefix-cache-bytes \(\d+\) is counted in --max-kv-bytes \(25%"):
        TargetRunner(loaded, 8, 60, 4, max_kv_bytes=MemoryShare(0.25), prefix_cache_bytes=available // 4)
    TargetRunner(loaded, 8, 60, 4, max_kv_bytes=MemoryShare(0.25), prefix_cache_bytes=available // 8)


def test_the_memory_available_is_measured():
    assert 0 < memory.available_bytes("cpu") <= memory.pool_bytes(0, 1, 1, "cpu") * 2


def draft_runner(loaded, tokens: int, min_confidence: float = 0.4):
    """A draft whose KV budget holds `tokens` entries, confidence stops on (the default)."""
    per_token = kv_bytes_per_token(loaded.model)
    return DraftRunner(
        loaded, 8, 60, 8, proposal_top_k=0, max_kv_bytes=tokens * per_token, min_confidence=min_confidence
    )


@pytest.mark.parametrize("path", ["alone", "batched"])
def test_a_budgeted_draft_caps_its_proposal_before_the_first_draw(loaded, path):
    """Issue 65: a draft refused mid-proposal by its KV budget would fail only the proposals
    no confidence stop had ended, so the target would verify a biased few. The cap comes from
    the call: a budget of 7 entries with a 5-token prompt allows 3 drafts (5 + 2 entries, the
    last draft not yet run), whatever the draws, alone, batched or with a long prefill first;
    a prompt that does not fit is refused before any draw, and the session is gone."""
    prompt = list(range(3, 8))
    calls = [ProposeCall(f"s{seed}", 0, prompt, 5, T1, seed=seed, min_confidence=0.0) for seed in range(6)]
    runner = draft_runner(loaded, len(prompt) + 2)
    proposals = [runner.propose_one(call) for call in calls] if path == "alone" else runner.propose_batch(calls)
    assert [len(p.token_ids) for p in proposals] == [3] * len(calls)
    too_long = ProposeCall("long", 0, list(range(3, 12)), 2, T1, seed=0)
    refused = runner.propose_batch([too_long])[0] if path == "batched" else None
    if path == "alone":
        with pytest.raises(ResourceExhausted):
            runner.propose_one(too_long)
    else:
        assert isinstance(refused, ResourceExhausted)
    assert runner.sessions.peek("long") is None


def test_a_capped_proposal_with_confidence_stops_is_the_same_whatever_the_budget_beyond_it(loaded):
    """The cap is a stopping time fixed by the call: seeded proposals under a budget equal the
    first drafts of the same seeds without one, cut at the cap or earlier at a confidence stop
    (at 0.1: the tiny model rarely draws a token it gives 0.4)."""
    prompt = list(range(3, 8))
    free = DraftRunner(loaded, 32, 60, 8, proposal_top_k=0, min_confidence=0.1)
    tight = draft_runner(loaded, len(prompt) + 1, 0.1)
    lengths = set()
    for seed in range(20):
        call = ProposeCall(f"s{seed}", 0, prompt, 4, T1, seed=seed)
        whole, capped = free.propose_one(call), tight.propose_one(call)
        assert capped.token_ids == whole.token_ids[:2]
        lengths.add(len(whole.token_ids))
    assert 1 in lengths and max(lengths) > 2, f"proposal lengths {lengths}: no confidence stop, or no cap to test"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_pool_sized_to_its_budget_compacts_rather_than_evict_below_it(loaded, static):
    """A CUDA pool holds the budget and a page a session, no more. Ten sessions growing by
    doubling, ending and starting again in a random order left no run long enough for a call
    while a quarter of the budget was free: the least recently used sessions were evicted (a
    re-prefill each) at 72% of it. Compacting the idle sessions' extents makes the room: no
    session is evicted below the budget, and every call's rows are bitwise those of a pool
    with room to spare."""
    per, budget = kv_bytes_per_token(loaded.model), 32 * PAGE_TOKENS
    tight = TargetRunner(loaded, 16, 600, 4, max_kv_bytes=budget * per)
    roomy = TargetRunner(loaded, 16, 600, 4)
    tiny_pool(tight, budget // PAGE_TOKENS + 10 + static)  # a static runner's scratch page is one more
    if static:
        tight.use_static_passes("on")
    lengths: dict[str, int] = {}
    draws = torch.Generator().manual_seed(0)
    for _ in range(220):
        session_id = f"s{int(torch.randint(0, 10, (1,), generator=draws))}"
        length, more = lengths.get(session_id, 0), int(torch.randint(1, 40, (1,), generator=draws))
        if length + more > 250:  # the tiny model's context: a new generation in its place
            for runner in (tight, roomy):
                runner.end_session(session_id)
            length = 0
        new_tokens = [1 + (length + i) % 40 for i in range(more)]
        got, expected = (
            runner.verify_one(
                VerifyCall(session_id, length, new_tokens, [], torch.zeros(0, loaded.vocab_size), GREEDY, 0, True)
            )
            for runner in (tight, roomy)
        )
        assert torch.equal(got.target_probs, expected.target_probs)
        lengths[session_id] = length + more
        assert tight.sessions.evicted == 0, f"evicted with {sum(lengths.values())} of the budget's {budget} tokens held"
    assert tight.pool.relocations > roomy.pool.relocations
