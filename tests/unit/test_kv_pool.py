"""The preallocated KV pool (specdec.engine.kv_pool): its page bookkeeping (safe from any thread,
as extents go back on whichever thread drops their cache), and a cache over one extent that
gives the logits a DynamicCache gives, bit for bit, through every kind of pass the services
run, while extents grow in place and move (to a run of the size needed where none twice its
size is free)."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specdec.engine import attention
from specdec.engine.kv_pool import Extent, KVPool, PageAllocator, PoolCache, PoolFull, compact
from specdec.engine.modeling import with_cache
from specdec.engine.tree_pass import keep_tree_path, tree_forward


def test_pages_are_taken_first_fit_merged_when_freed_and_never_freed_twice():
    pages = PageAllocator(10)
    assert [pages.alloc(3), pages.alloc(2), pages.alloc(4)] == [0, 3, 5]
    assert pages.runs() == [(9, 1)]
    with pytest.raises(PoolFull, match="no free run of 2 pages"):
        pages.alloc(2)
    pages.free(3, 2)
    assert pages.runs() == [(3, 2), (9, 1)]
    assert not pages.extend(0, 3, 3) and pages.extend(0, 3, 2)  # only what is free after it
    assert pages.runs() == [(9, 1)]
    pages.free(0, 5)
    pages.free(5, 4)  # merges with both neighbours: one run again
    assert pages.runs() == [(0, 10)] and pages.free_pages == 10
    with pytest.raises(ValueError, match="freed twice"):
        pages.free(2, 1)
    with pytest.raises(ValueError, match="at least one page"):
        pages.alloc(0)


def test_pages_taken_and_given_back_on_two_threads_stay_consistent():
    """An extent goes back on whichever thread drops its cache (a weakref finalizer), while the
    model thread takes pages: unlocked, the runs' list and lengths went apart (a KeyError
    within a few thousand rounds with the interpreter switching threads every microsecond)."""
    pages, live, guard, problems = PageAllocator(64), set(), threading.Lock(), []

    def churn() -> None:
        for _ in range(20_000):
            try:
                start = pages.alloc(1)
            except PoolFull:
                continue
            except Exception as exc:  # noqa: BLE001 - the bookkeeping broke: reported below
                problems.append(repr(exc))
                return
            with guard:
                if start in live:
                    problems.append(f"page {start} given out twice")
                live.add(start)
            with guard:
                live.discard(start)
            pages.free(start, 1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert problems == [] and pages.runs() == [(0, 64)]


def test_an_extent_that_cannot_double_moves_to_a_run_of_the_size_it_needs():
    pool = KVPool(layers=1, kv_heads=1, head_dim=4, pages=100, page_tokens=4)
    grown = pool.open(40 * 4)  # pages [0, 40)
    neighbour = pool.open(1)  # [40, 41): no growth in place
    grown.lengths[:] = [40 * 4]
    grown.reserve(41 * 4)  # no free run of 80 pages, one of 59
    assert grown.extent.pages == 41 and pool.allocator.runs() == [(0, 40), (82, 18)]
    assert neighbour.extent.start == 40


def test_an_extent_whose_needed_run_is_its_doubled_one_asks_the_allocator_once():
    pool = KVPool(layers=1, kv_heads=1, head_dim=4, pages=10, page_tokens=4)
    grown = pool.open(2 * 4)  # pages [0, 2)
    others = [pool.open(1), pool.open(5 * 4)]  # [2, 3): no growth in place; [3, 8): two pages left
    asked = []
    alloc = pool.allocator.alloc
    pool.allocator.alloc = lambda pages: asked.append(pages) or alloc(pages)
    with pytest.raises(PoolFull):
        grown.reserve(4 * 4)  # four pages: twice its two, the run it needs too
    assert asked == [4] and grown.extent == Extent(0, 2) and len(others) == 2


def test_the_pages_around_an_extent_are_taken_after_it_first_then_before_it():
    pages = PageAllocator(20)
    for size in (4, 3, 2, 5):
        pages.alloc(size)  # [0, 4) [4, 7) [7, 9) [9, 14); [14, 20) free
    pages.free(0, 4)
    pages.free(7, 2)  # the extent [4, 7) has 4 free pages before it and 2 after
    with pytest.raises(PoolFull):
        pages.around(4, 3, 10)
    assert pages.runs() == [(0, 4), (7, 2), (14, 6)]  # nothing taken
    assert pages.around(4, 3, 6) == 3  # both after, one before
    assert pages.runs() == [(0, 3), (14, 6)]
    assert pages.around(3, 6, 9) == 0  # all of the run before
    assert pages.runs() == [(14, 6)]


def test_an_extent_with_no_run_elsewhere_grows_down_into_the_free_pages_before_it():
    """Where no free run is long enough, the free pages right before and after an extent, with
    its own, still are: its entries move down (in steps no longer than the move, so none is
    overwritten before it is copied), the columns they leave are zeroed, and every page is
    accounted for. It used to be refused with most of the pool free."""
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, pages=12, page_tokens=4)
    below = pool.open(3 * 4)  # pages [0, 3)
    grown = pool.open(5 * 4)  # [3, 8)
    above = pool.open(2 * 4)  # [8, 10); [10, 12) free
    used = 5 * 4 - 1
    entries = torch.arange(used * 2, dtype=torch.float32).reshape(1, used, 2) + 1  # [H, used, D], none 0
    with torch.inference_mode():
        for arena in (*pool.keys, *pool.values):
            arena[:, 12 : 12 + used] = entries
    grown.lengths[:] = [used]
    below.release()  # [0, 3) free: 5 pages free in all, in two runs of 3 and 2
    grown.reserve(7 * 4)  # 7 pages: none free elsewhere; 2 of the 3 before, with its own 5
    assert grown.extent == Extent(1, 7) and pool.allocator.runs() == [(0, 1), (10, 2)]
    assert above.extent == Extent(8, 2)
    for arena in (*pool.keys, *pool.values):
        assert torch.equal(arena[:, 4 : 4 + used], entries)  # moved down 8 columns, through its old place
        assert not arena[:, 4 + used : 12 + used].any()  # what they left behind
    with pytest.raises(PoolFull):
        grown.reserve(9 * 4)  # 9 pages: all of the free ones around it, with its own, are 8


def filled(pool: KVPool, cache: PoolCache, used: int, base: float) -> torch.Tensor:
    """Writes `used` distinct nonzero entries at the start of `cache`'s extent, every arena."""
    entries = base + torch.arange(used * 2, dtype=torch.float32).reshape(1, used, 2) + 1  # [H, used, D]
    start = cache.extent.start * pool.page_tokens
    with torch.inference_mode():
        for arena in (*pool.keys, *pool.values):
            arena[:, start : start + used] = entries
    cache.lengths[:] = [used]
    return entries


def test_compacting_trims_extents_to_their_entries_and_moves_them_to_the_lowest_free_runs():
    """Extents grown by doubling and sessions ended between others leave enough pages free for a
    run but none long enough: compacting gives back the pages past each movable cache's entries
    and moves it to the lowest free run that holds it, so the free pages join at the top. Entries keep their
    values, the pages left read zero, a cache not given (one a pass runs) stays where it is, and
    nothing moves where even then no run of the pages asked for could be made."""
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, pages=16, page_tokens=4)
    ended, a, pinned, b = pool.open(2 * 4), pool.open(4 * 4), pool.open(4 * 4), pool.open(4 * 4)  # [0, 14)
    a_entries, pinned_entries = filled(pool, a, 5, 0.0), filled(pool, pinned, 9, 100.0)
    b_entries = filled(pool, b, 2, 200.0)
    ended.release()
    assert pool.allocator.runs() == [(0, 2), (14, 2)]
    with pytest.raises(PoolFull) as full:
        pool.open(4 * 4)
    assert full.value.pages == 4
    assert not compact([a, b], pages=10)  # 4 free and 2 + 3 past the entries: no run of 10 could be made
    assert (a.extent, b.extent, pool.relocations) == (Extent(2, 4), Extent(10, 4), 0)
    assert compact([a, b], pages=4)
    assert (a.extent, pinned.extent, b.extent) == (Extent(0, 2), Extent(6, 4), Extent(2, 1))
    assert pool.allocator.runs() == [(3, 3), (10, 6)] and pool.relocations == 2
    for arena in (*pool.keys, *pool.values):
        assert torch.equal(arena[:, 0:5], a_entries) and torch.equal(arena[:, 8:10], b_entries)
        assert torch.equal(arena[:, 24:33], pinned_entries)
        assert not arena[:, 10:24].any() and not arena[:, 33 + 3 : 64].any()  # free pages, and past pinned's entries
    assert pool.open(6 * 4).extent == Extent(10, 6)
    assert not compact([a, b])  # nothing left to trim or slide


CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    built = {}
    for implementation in ("sdpa", "eager", attention.NAME, attention.EVERY_ROW):
        model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).eval()
        model.config._attn_implementation = implementation
        built[implementation] = model
    reference = built["sdpa"].state_dict()
    for model in built.values():
        model.load_state_dict(reference)
    return built


def poisoned_pool(pages: int) -> KVPool:
    """A pool of 4-token pages whose every entry is NaN: an entry read before it was written
    makes the logits NaN, so equal logits prove no stale entry is ever attended."""
    pool = KVPool(layers=2, kv_heads=2, head_dim=8, pages=pages, page_tokens=4)
    with torch.inference_mode():
        for arena in (*pool.keys, *pool.values):
            arena.fill_(float("nan"))
    return pool


@pytest.mark.parametrize("implementation", ["sdpa", "eager", attention.NAME, attention.EVERY_ROW])
def test_a_pool_cache_gives_dynamic_cache_logits_bit_for_bit(models, implementation):
    model = models[implementation]
    pool = poisoned_pool(pages=40)
    cache, reference = pool.open(4), DynamicCache(config=model.config)
    neighbour = pool.open(4)  # takes the page after the cache's: its first growth moves it
    assert (cache.extent.start, neighbour.extent.start) == (0, 1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(1))
    seen = [("opened", cache.extent)]

    def both(run, what):
        with torch.inference_mode():
            expected, got = run(reference), run(cache)
        assert torch.equal(expected, got), (what, (expected - got).abs().max().item())
        assert cache.get_seq_length() == reference.get_seq_length(), what
        seen.append((what, cache.extent))

    def forward(ids):
        return lambda kv: model(input_ids=ids, use_cache=True, **with_cache(model, kv)).logits

    both(forward(tokens[:, :9]), "a 9-token prefill")  # outgrows its page: moved past the neighbour
    for step in range(3):
        both(forward(tokens[:, 9 + step : 10 + step]), f"decode {step}")
    reference.crop(-2), cache.crop(-2)
    both(forward(tokens[:, 10:15]), "a 5-token verify after a rollback of 2")
    reference.crop(-4), cache.crop(-4)
    both(forward(tokens[:, 11:12]), "a decode after a rollback of 4")
    both(forward(tokens[:, 12:40]), "a 28-token chunk")
    both(lambda kv: tree_forward(model, kv, [3], [5, 6, 7, 8, 9], [0, 0, 1, 1, 3]), "a tree verify")
    committed = reference.get_seq_length() - 5
    keep_tree_path(reference, committed, [1, 3])
    keep_tree_path(cache, committed, [1, 3])  # PoolCache.keep_path: the same gather, in the extent
    both(forward(tokens[:, 40:41]), "a decode after keeping a tree path")
    extents = {extent for _, extent in seen}
    assert pool.relocations == 1 and len({extent.start for extent in extents}) == 2  # moved once
    assert len(extents) >= 4  # and grew in place after that
    assert not torch.isnan(model(input_ids=tokens[:, :1]).logits).any()


def test_a_full_pool_refuses_room_before_a_pass_and_a_released_extent_is_zeroed_and_reused():
    pool = KVPool(layers=2, kv_heads=2, head_dim=8, pages=4, page_tokens=4)
    first = pool.open(8)
    second = pool.open(8)
    with pytest.raises(PoolFull):
        first.reserve(12)  # nothing after it is free, and no run of 4 pages is
    assert first.extent.pages == 2 and max(first.lengths) == 0
    with torch.inference_mode():
        keys = torch.ones(1, 2, 3, 8)
        for layer in second.layers:
            layer.update(keys, keys)
    assert second.reserved_bytes == 8 * pool.bytes_per_token and second.get_seq_length() == 3
    second.release()
    with pytest.raises(RuntimeError, match="released"):
        second.reserve(1)
    assert all(not arena.any() for arena in (*pool.keys, *pool.values))  # zeroed: nothing stale to read
    assert pool.open(8).extent == second.extent


def test_a_pool_sized_by_bytes_fits_them_and_commits_memory_only_as_written():
    config = Qwen2Config(**{**CONFIG, "num_hidden_layers": 4})
    pool = KVPool.for_bytes(config, 1 << 20, torch.float32)
    # 2 · 4 layers · 2 KV heads · 8 dims · 4 bytes = 512 bytes a token; 1 MiB = 2,048 tokens = 32 pages.
    assert pool.bytes_per_token == 512 and pool.capacity_tokens == 2048 and pool.allocator.pages == 32
    assert pool.keys[0].shape == (2, 2048, 8) and not pool.keys[0].any()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_cpu_memory_is_committed_as_written_and_given_back_when_an_extent_is_freed():
    """128 MiB of arenas: nothing resident at first, about what a session wrote once it has,
    and that given back when it ends; the freed memory reads zeros."""
    pool = KVPool(layers=2, kv_heads=2, head_dim=64, pages=256, page_tokens=256)
    assert pool.capacity_tokens * pool.bytes_per_token == 128 << 20
    entries = torch.full((1, 2, 32 * 1024, 64), 0.5)
    before = resident_bytes()
    cache = pool.open(32 * 1024)  # half the pool: 64 MiB once written
    with torch.inference_mode():
        for layer in cache.layers:
            layer.update(entries, entries)
    written = resident_bytes() - before
    assert 60 << 20 <= written <= 68 << 20, written
    cache.release()
    assert resident_bytes() - before < 4 << 20
    assert all(not arena.any() for arena in (*pool.keys, *pool.values))


def test_a_model_service_keeps_every_session_in_its_pool_and_frees_what_it_drops(tiny_pair):
    """The runners' one KV path: a session's cache is an extent of the runner's pool; a fork
    copies into an extent of its own; ending a session, or the store evicting it, gives the
    pages back; a session the store dropped while a call still holds it keeps its entries."""
    from specdec.engine.modeling import load_causal_lm
    from specdec.sampling.probs import SamplingParams
    from target_service.runner import TargetRunner, VerifyCall

    loaded = load_causal_lm(str(tiny_pair.target), "float32", "cpu")
    runner = TargetRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    pool = runner.pool
    assert pool is not None and pool.allocator.free_pages == pool.allocator.pages

    def verify(session_id: str, keep: int, tokens: list[int]) -> None:
        runner.verify_one(
            VerifyCall(session_id, keep, tokens, [], torch.zeros(0, loaded.vocab_size), SamplingParams(), 0)
        )

    verify("a", 0, list(range(3, 100)))  # 97 tokens: two 64-token pages
    session = runner.sessions.peek("a")
    assert isinstance(session.cache, PoolCache) and session.cached_tokens == 97
    views = sum(t.nbytes for layer in session.cache.layers for t in (layer.keys, layer.values))
    assert session.kv_bytes == session.cache.used_bytes == views == 97 * runner.kv_bytes_per_token
    assert pool.allocator.free_pages == pool.allocator.pages - 2
    fork = runner.sessions.fork("a", "b", 40, epoch=0)
    assert isinstance(fork.cache, PoolCache) and fork.cache.extent != session.cache.extent
    assert torch.equal(fork.cache.layers[0].keys, session.cache.layers[0].keys[:, :, :40])
    held = runner.sessions.peek("b")
    runner.sessions.end("b")
    assert pool.allocator.free_pages == pool.allocator.pages - 3  # a call still holds "b"
    del held, fork
    assert pool.allocator.free_pages == pool.allocator.pages - 2  # now nothing does
    del session
    runner.end_session("a")
    assert pool.allocator.free_pages == pool.allocator.pages


def test_freeing_hands_each_arenas_own_memory_back(monkeypatch):
    """free() paired arenas (all keys, then all values) with their memory (key and value layer
    by layer): the system got back another arena's pages. Harmless while every arena has one
    shape and frees one extent at once; wrong the day they differ."""
    pool = KVPool(layers=3, kv_heads=1, head_dim=64, pages=8, page_tokens=16)
    cache = pool.open(64)
    paired = []

    def release(arena, memory, head, columns):
        paired.append(arena.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(memory)))

    monkeypatch.setattr(KVPool, "_release", staticmethod(release))
    cache.release()
    assert paired and all(paired)
