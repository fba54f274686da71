"""The prefix cache: a session that starts the way a finished one did takes its prompt blocks
instead of prefilling them, and what it takes is bitwise what a fresh prefill computes (float32
and int8 targets). Namespaces never share blocks; the bytes count in the KV budget and go
before any live session does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.engine import attention, prefix_cache
from specdec.engine.kv_pool import KVPool, kv_geometry
from specdec.engine.modeling import load_causal_lm
from specdec.engine.quantize import INT8_LABEL, int8_supported, quantize_int8
from specdec.engine.sessions import SessionStore
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

GREEDY = SamplingParams()
BLOCK = 8


@pytest.fixture(scope="module", params=["float32", "int8"])
def loaded(request, tiny_pair):
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    if request.param == "int8":
        if not int8_supported():
            pytest.skip("this torch build has no fbgemm int8 kernels")
        quantize_int8(loaded.model)
        loaded = dataclasses.replace(loaded, quantization=INT8_LABEL)
    return loaded


def runner_for(loaded, prefix_bytes=1 << 24, **kwargs) -> TargetRunner:
    return TargetRunner(
        loaded,
        max_sessions=8,
        session_ttl_s=60,
        max_speculative_tokens=4,
        prefix_cache_bytes=prefix_bytes,
        prefix_block_tokens=BLOCK,
        **kwargs,
    )


def verify(runner, session_id, keep, new_tokens, drafts=(), namespace=""):
    vocab = runner.loaded.vocab_size
    call = VerifyCall(
        session_id, keep, list(new_tokens), list(drafts), torch.zeros(0, vocab), GREEDY, 0, cache_namespace=namespace
    )
    admitted = runner._admit(call)
    return runner._forward_round(admitted), admitted


def kv(runner, session_id):
    session = runner.sessions.open(session_id, 1)
    return [(layer.keys.clone(), layer.values.clone()) for layer in session.model_cache().layers]


PROMPT = [(7 * i + 3) % 50 + 1 for i in range(37)]  # 4 whole blocks and 5 tokens
OTHER = PROMPT[:32] + [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]  # shares the 4 blocks, then differs


def test_a_hit_holds_bitwise_what_a_fresh_prefill_computes(loaded):
    warm = runner_for(loaded)
    verify(warm, "first", 0, PROMPT)
    assert warm.end_session("first") and len(warm.sessions.prefix) == 4
    assert len(warm.sessions.prefix.holdings()) == 4  # pages of the sessions' pool, a block a page
    before = warm.processed_tokens_total
    logits, admitted = verify(warm, "second", 0, OTHER, drafts=[4, 5])
    assert warm.processed_tokens_total - before == len(OTHER) + 2 - 32, "the 4 cached blocks ran again"
    assert warm.describe().prefix_cache[3:] == (2, 1, 32)  # lookups, hits, tokens saved

    cold = runner_for(loaded)  # the same service, nothing cached: prefills every block itself
    fresh_logits, _ = verify(cold, "second", 0, OTHER, drafts=[4, 5])
    assert cold.sessions.prefix.hits == 0
    for (keys, values), (fresh_keys, fresh_values) in zip(kv(warm, "second"), kv(cold, "second"), strict=True):
        assert torch.equal(keys, fresh_keys) and torch.equal(values, fresh_values)
    assert torch.equal(logits, fresh_logits)


def test_the_bitwise_check_catches_a_block_keyed_by_its_own_tokens(loaded, monkeypatch):
    """Mutation check: keyed by its own tokens instead of everything before it, a block is
    found at another position (here "1 2 … 8" twice) and hands over entries computed there.
    The check above must see it; a χ² test over the tiny models would not (the change moves
    their next-token distribution by about 0.02 in total variation)."""

    def parentless(self, namespace, token_ids, blocks):
        size = self.block_tokens
        for start in range(0, blocks * size, size):
            chunk = tuple(token_ids[start : start + size])
            yield prefix_cache.block_key(b"", namespace, chunk), b"", chunk

    monkeypatch.setattr(prefix_cache.PrefixCache, "_chain", parentless)
    repeated = list(range(1, 9)) * 2 + [20, 21, 22]
    warm = runner_for(loaded)
    verify(warm, "first", 0, repeated)
    warm.end_session("first")
    verify(warm, "second", 0, repeated)
    assert warm.sessions.prefix.tokens_saved == 16
    cold = runner_for(loaded)
    verify(cold, "second", 0, repeated)
    assert not all(
        torch.equal(keys, fresh_keys) and torch.equal(values, fresh_values)
        for (keys, values), (fresh_keys, fresh_values) in zip(kv(warm, "second"), kv(cold, "second"))
    )


def test_only_block_aligned_prefill_is_cached(loaded):
    runner = runner_for(loaded)
    verify(runner, "s", 0, PROMPT)
    # Decode steps (verify passes) extend the session past more whole blocks: not cacheable.
    verify(runner, "s", len(PROMPT), [1, 2, 3, 4, 5, 6, 7, 8])
    verify(runner, "s", len(PROMPT) + 8, [9, 10, 11, 12])
    assert runner.sessions.open("s", 1).aligned_tokens == 32
    runner.end_session("s")
    assert len(runner.sessions.prefix) == 4


@pytest.fixture(scope="module")
def per_token_exact(tiny_pair):
    """The int8 tiny target with per-row attention over every row, as the target service
    loads an int8 target with a prefix cache."""
    if not int8_supported():
        pytest.skip("this torch build has no fbgemm int8 kernels")
    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    quantize_int8(loaded.model)
    loaded.model.set_attn_implementation(attention.EVERY_ROW)
    return dataclasses.replace(loaded, quantization=INT8_LABEL)


def test_a_per_token_exact_target_keeps_prompts_it_ran_in_batched_passes(per_token_exact):
    """A batched (padded) pass's entries are not kept, so a prompt that arrives beside
    another runs alone up to its scored tokens first."""
    runner = runner_for(per_token_exact)
    vocab = runner.loaded.vocab_size
    calls = [
        VerifyCall(name, 0, list(prompt), [3], torch.zeros(0, vocab), GREEDY, 0)
        for name, prompt in (("a", PROMPT), ("b", OTHER))
    ]
    assert all(not isinstance(result, Exception) for result in runner.verify_batch(calls))
    runner.end_session("a")
    runner.end_session("b")
    assert len(runner.sessions.prefix) == 4 + 1  # PROMPT's 4 blocks, and OTHER's fifth (its first 4 are PROMPT's)


def test_a_per_token_exact_target_keeps_its_decoded_tokens_too(per_token_exact):
    """An int8 target with per-row attention over every row computes each token's entries
    alike in any pass, so what a session decoded (verify passes) is kept as well, and a next
    turn that starts with the whole conversation finds it: bitwise what one fresh prefill of
    that conversation computes, in a service with no prefix cache at all."""
    loaded = per_token_exact
    warm = runner_for(loaded)
    assert warm.per_token_exact
    verify(warm, "turn-1", 0, PROMPT)  # 37 tokens
    verify(warm, "turn-1", len(PROMPT), [1, 2, 3, 4, 5])  # decoding: 5 more, 42 in all
    verify(warm, "turn-1", len(PROMPT) + 5, [6])
    warm.end_session("turn-1")
    assert len(warm.sessions.prefix) == 5  # every whole block of 43 tokens, decoded ones too
    turn = PROMPT + [1, 2, 3, 4, 5, 6] + [30, 31, 32]
    before = warm.processed_tokens_total
    logits, _ = verify(warm, "turn-2", 0, turn, drafts=[4])
    assert warm.processed_tokens_total - before == len(turn) + 1 - 40

    plain = TargetRunner(loaded, max_sessions=2, session_ttl_s=60, max_speculative_tokens=4)  # no prefix cache
    fresh_logits, _ = verify(plain, "turn-2", 0, turn, drafts=[4])
    for (keys, values), (fresh_keys, fresh_values) in zip(kv(warm, "turn-2"), kv(plain, "turn-2"), strict=True):
        assert torch.equal(keys, fresh_keys) and torch.equal(values, fresh_values)
    assert torch.equal(logits, fresh_logits)


def test_namespaces_never_share_blocks(loaded):
    runner = runner_for(loaded)
    verify(runner, "a", 0, PROMPT, namespace="tenant-a")
    runner.end_session("a")
    before = runner.processed_tokens_total
    verify(runner, "b", 0, PROMPT, namespace="tenant-b")
    assert runner.processed_tokens_total - before == len(PROMPT) and runner.sessions.prefix.hits == 0
    verify(runner, "a2", 0, PROMPT, namespace="tenant-a")
    assert runner.sessions.prefix.hits == 1


def test_a_failed_or_discarded_session_leaves_nothing(loaded):
    runner = runner_for(loaded)
    verify(runner, "s", 0, PROMPT)
    runner.sessions.end("s")  # the path a failed pass takes: its cache is not trusted
    verify(runner, "branch", 0, PROMPT)
    runner.end_session("branch", keep=False)  # EndSessionRequest.discard: no request's output
    assert len(runner.sessions.prefix) == 0


def test_cached_bytes_count_in_the_budget_and_go_before_sessions(loaded):
    per_token = runner_for(loaded).kv_bytes_per_token
    runner = runner_for(loaded, prefix_bytes=40 * per_token, max_kv_bytes=80 * per_token)
    verify(runner, "done", 0, PROMPT)
    runner.end_session("done")
    assert runner.sessions.prefix.bytes == 32 * per_token
    assert runner.describe().kv_cache_bytes == 32 * per_token
    verify(runner, "live", 0, OTHER[:8] + [40] * 30)  # 38 tokens: 70 > 80 - 32 leaves
    verify(runner, "big", 0, [41] * 30)  # 68 + 30 > 80: the cache gives up blocks, no session goes
    assert runner.sessions.evicted == 0 and runner.sessions.prefix.evicted_blocks > 0
    assert runner.sessions.kv_bytes() <= 80 * per_token


def test_the_cache_keeps_within_its_bytes_evicting_leaves_first(loaded):
    per_token = runner_for(loaded).kv_bytes_per_token
    runner = runner_for(loaded, prefix_bytes=3 * BLOCK * per_token)
    verify(runner, "s", 0, PROMPT)
    runner.end_session("s")
    assert len(runner.sessions.prefix) == 3  # the 4th block did not fit
    before = runner.processed_tokens_total
    verify(runner, "t", 0, PROMPT)
    assert runner.processed_tokens_total - before == len(PROMPT) - 24  # the chain's 3 blocks serve
    # A new prompt's block needs room: the least recently used leaf goes, never a parent first.
    runner.end_session("t")
    verify(runner, "u", 0, [45] * 12)
    runner.end_session("u")
    verify(runner, "v", 0, PROMPT)
    assert runner.sessions.prefix.tokens_saved == 24 + 16


def test_an_int8_cpu_target_is_per_token_exact_without_a_prefix_cache(tiny_pair):
    """The service loads an int8 CPU target with per-row attention over every row whether or
    not a prefix cache is on, so a service without the cache computes what one with it does."""
    if not int8_supported():
        pytest.skip("this torch build has no fbgemm int8 kernels")
    from target_service.config import TargetConfig
    from target_service.loading import load_runner
    from tests.stack import model_service_config

    runner = load_runner(model_service_config(TargetConfig, tiny_pair.target, quantize="int8"))
    assert runner.sessions.prefix is None and runner.per_token_exact


def test_a_per_token_exact_target_cuts_a_long_prefill_into_passes_with_the_same_bits(per_token_exact, monkeypatch):
    """A long prompt runs in passes of at most EXACT_PASS_TOKENS, and its entries and logits
    are bitwise those of one pass over it; and a session re-prefilled after an eviction (its
    prompt and what it decoded, in one run) has bitwise the entries of the one that decoded."""
    from specdec.engine import runner as runner_module

    prompt = PROMPT + OTHER  # 80 tokens
    one = TargetRunner(per_token_exact, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    one_logits, _ = verify(one, "s", 0, prompt, drafts=[4])

    monkeypatch.setattr(runner_module, "EXACT_PASS_TOKENS", 16)
    cut = TargetRunner(per_token_exact, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    passes: list[int] = []
    forward = cut._forward_admitted
    monkeypatch.setattr(cut, "_forward_admitted", lambda s, ids, keep: passes.append(len(ids)) or forward(s, ids, keep))
    cut_logits, _ = verify(cut, "s", 0, prompt, drafts=[4])
    assert passes == [16, 16, 16, 16, 17]  # whole passes, then the prompt's rest with the scored tokens
    assert torch.equal(cut_logits, one_logits)
    for (keys, values), (one_keys, one_values) in zip(kv(cut, "s"), kv(one, "s"), strict=True):
        assert torch.equal(keys, one_keys) and torch.equal(values, one_values)

    # Decode on `one`, then re-prefill the whole sequence on `cut`, as after an eviction.
    decoded = [4, 9, 12, 30]
    verify(one, "s", len(prompt) + 1, decoded[1:])
    cut.end_session("s")
    verify(cut, "s", 0, prompt + decoded)
    for (keys, values), (one_keys, one_values) in zip(kv(cut, "s"), kv(one, "s"), strict=True):
        assert torch.equal(keys, one_keys) and torch.equal(values, one_values)


def test_blocks_are_pages_of_the_sessions_pool_given_up_and_moved_before_any_session(loaded):
    """The blocks sit in the pool the sessions do, a page each, so a pool sized to the budget
    (as on CUDA) holds all of the service's KV: before, they were tensors beside it, up to
    --prefix-cache-bytes more on the device. Where the pool has no run for a call, blocks are
    moved (compacted) and then given up, before any session is evicted; a hit from moved
    blocks is still bitwise a fresh prefill."""
    runner = runner_for(loaded)
    assert runner.pool is not None and runner.pool.page_tokens == BLOCK  # with the cache on, a page is a block
    layers, heads, dim = kv_geometry(loaded.model.config)
    runner.pool = pool = KVPool(
        layers, heads, dim, pages=14, dtype=loaded.model.dtype, page_tokens=BLOCK
    )  # a tight one
    verify(runner, "idle", 0, [45] * 10)  # pages [0, 2)
    verify(runner, "first", 0, PROMPT)  # 37 tokens: [2, 7)
    runner.end_session("first")  # its 4 blocks copied to pages 7-10, then its pages freed
    blocks = runner.sessions.prefix.holdings()
    assert len(blocks) == 4 and all(block.pool is pool for block in blocks)
    assert all(not block.tensors for block in runner.sessions.prefix._blocks.values())
    assert sorted(block.extent.start for block in blocks) == [7, 8, 9, 10]
    verify(runner, "other", 0, [46] * 30)  # [2, 6); free: 6 and [11, 14)
    verify(runner, "other", 30, [47] * 20)  # needs 7 pages: 4 free in all
    # The 3 least recently used blocks (the chain's last) give up their pages, the 4th moves to
    # page 6, and "other" to the 7 pages after it: no session is evicted.
    assert runner.sessions.evicted == 0 and runner.sessions.prefix.evicted_blocks == 3
    assert [block.extent.start for block in runner.sessions.prefix.holdings()] == [6]
    assert runner.sessions.peek("other").cache.extent.start == 7
    verify(runner, "idle", 10, [45])  # still held
    runner.end_session("other")
    saved = runner.sessions.prefix.tokens_saved
    verify(runner, "second", 0, OTHER)
    assert runner.sessions.prefix.tokens_saved - saved == BLOCK  # from the moved block
    cold = runner_for(loaded)
    verify(cold, "second", 0, OTHER)
    for (keys, values), (fresh_keys, fresh_values) in zip(kv(runner, "second"), kv(cold, "second"), strict=True):
        assert torch.equal(keys, fresh_keys) and torch.equal(values, fresh_values)


def test_blocks_are_compacted_where_no_idle_session_is_left_to_move():
    """The pool used to be found from the idle sessions alone: with none (every other session
    in the caller's batch), blocks that moving would have fitted were given up instead."""
    pool = KVPool(1, 1, 2, pages=12, page_tokens=2)
    store = SessionStore(10, 1e9, pool.open, 0, prefix_cache.PrefixCache(2, 1 << 30))
    first = store.open("first", 0)
    with torch.inference_mode():
        first.cache.reserve(8)
        for layer in first.cache.layers:
            layer.update(torch.randn(1, 1, 8, 2), torch.randn(1, 1, 8, 2))
    first.tokens, first.aligned_tokens = list(range(8)), 8
    grows = store.open("grows", 0)  # page 4
    store.finish("first")
    del first  # its 4 blocks in pages 5-8, its own pages [0, 4) free
    assert sorted(block.extent.start for block in store.prefix.holdings()) == [5, 6, 7, 8]
    store.make_room(grows, 12 * pool.bytes_per_token, pool.bytes_per_token)  # 6 pages: no run of 6 is free
    assert store.prefix.evicted_blocks == 0 and len(store.prefix) == 4 and grows.cache.extent.pages == 6
