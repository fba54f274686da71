"""The preallocated KV pool both model services keep every session's cache in: an extent of
one arena per layer, written in place.

A transformers `DynamicCache` concatenates: each pass copies the session's whole KV into new
tensors (about 122 µs a layer for the keys at 2k tokens, 721 µs at 8k, against 7-12 µs for an
in-place write, one thread of a 2-core AMD EPYC). Here the memory is allocated once:

- `KVPool`: per layer, keys and values as [H, T, D] arenas (head-major: a session's entries
  for one head are contiguous, the layout SDPA reads fastest on CPU), T = pages × page tokens.
  On CPU the arenas are private anonymous memory, zero-filled and committed only as written,
  so a large pool costs nothing until used. Its size: `specdec.engine.memory.pool_bytes`.
- `PageAllocator` (specdec.engine.pages): which pages are free; a session owns one contiguous
  run of them (an extent), so attention reads its entries as a view, with no gather.
- `PoolCache` / `PoolLayer`: a transformers cache over one extent. A pass writes its new
  entries after the session's length and attends to the [1, H, length, D] view; a rollback
  only moves the length. An extent too short for a pass grows in place when the next pages are
  free, else moves to a run twice its size (one copy of the entries, amortised over the
  tokens that filled it: never a copy a step), or where none is free, down into the free
  pages before it. A fork copies its prefix into an extent of its
  own; a batched pass's rows and a prefix-cache hit are copied in once (`load`). The prefix
  cache's blocks are pages of the pool too (specdec.engine.prefix_cache.Block).
  Where no run is long enough but enough pages are free, idle sessions' extents are trimmed
  to their entries and moved down (`compact`) before any session is evicted.

What stays on transformers' own cache: models whose cache has other layer kinds (sliding
windows) and models spread over several devices (specdec.engine.runner.ModelRunner).

Logits equal DynamicCache's bit for bit with every attention implementation the services use
(tests/unit/test_kv_pool.py).
"""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.engine.pages import PageAllocator, PoolFull

PAGE_TOKENS = 64  # tokens per page: the unit of allocation (the prefix cache's block, by default)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Any]:
    """A zero-filled tensor, and what keeps its memory alive. On CPU: private anonymous memory,
    committed page by page as it is written (`torch.zeros` would touch, and commit, all of it)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    count = 1
    for size in shape:
        count *= size
    nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    memory = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape), memory


class KVPool:
    """Keys and values of every session of one model, preallocated: per layer an arena of
    [H, pages × PAGE_TOKENS, D] for each. Sessions take extents (`open`) and give them back
    (`PoolCache.release`)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        pages: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        page_tokens: int = PAGE_TOKENS,
    ) -> None:
        self.page_tokens = page_tokens
        self.allocator = PageAllocator(pages)
        self.dtype, self.device = dtype, torch.device(device)
        shape = (kv_heads, pages * page_tokens, head_dim)
        self._memory: list[Any] = []
        self.keys: list[torch.Tensor] = []  # per layer [H, T, D]
        self.values: list[torch.Tensor] = []
        with torch.inference_mode():  # the passes that write them run in inference mode
            for _ in range(layers):
                for arenas in (self.keys, self.values):
                    tensor, memory = _zeroed(shape, dtype, self.device)
                    arenas.append(tensor)
                    self._memory.append(memory)
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.relocations = 0  # extents moved to grow or compact (each one copy of a session's entries)

    @classmethod
    def for_bytes(
        cls,
        config,
        max_bytes: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        shards: int = 1,
        block_tokens: int = 0,
    ) -> KVPool:
        """A pool of a model (its transformers config) holding at most `max_bytes` of KV; under
        tensor parallelism (`shards` ranks) each rank's pool holds its share of the KV heads.
        Its pages are PAGE_TOKENS long, or a prefix cache's `block_tokens` where those divide
        it, so that each block is a page (specdec.engine.prefix_cache)."""
        page_tokens = block_tokens if block_tokens and PAGE_TOKENS % block_tokens == 0 else PAGE_TOKENS
        layers, kv_heads, head_dim = kv_geometry(config)
        kv_heads //= shards
        per_page = 2 * layers * kv_heads * head_dim * page_tokens
        per_page *= torch.empty((), dtype=dtype).element_size()
        return cls(layers, kv_heads, head_dim, max(max_bytes // per_page, 1), dtype, device, page_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.pages * self.page_tokens

    def pages_for(self, tokens: int) -> int:
        """The pages an extent needs to hold `tokens` entries: one at least."""
        return max(-(-tokens // self.page_tokens), 1)

    def open(self, tokens: int = 1) -> PoolCache:
        """A cache of its own, empty, with room for `tokens` entries; PoolFull if none is free."""
        pages = self.pages_for(tokens)
        return PoolCache(self, Extent(self.allocator.alloc(pages), pages))

    def columns(self, extent: Extent) -> slice:
        """The arenas' token columns an extent spans."""
        start = extent.start * self.page_tokens
        return slice(start, start + extent.pages * self.page_tokens)

    def grow(self, extent: Extent, tokens: int, used: int) -> Extent:
        """An extent with room for `tokens` holding the first `used` entries of `extent`: the
        same one extended in place where the pages after it are free, else a run of at least
        twice its size, or where none is free one of the size needed, with the entries copied
        there (and `extent` freed). PoolFull if none."""
        pages = -(-tokens // self.page_tokens)
        if pages <= extent.pages:
            return extent
        if self.allocator.extend(extent.start, extent.pages, pages - extent.pages):
            return Extent(extent.start, pages)
        try:
            doubled = max(pages, 2 * extent.pages)
            moved = Extent(self.allocator.alloc(doubled), doubled)
        except PoolFull:  # no run twice its size: the run it needs (the growth is not amortised then)
            try:
                if doubled == pages:
                    raise
                moved = Extent(self.allocator.alloc(pages), pages)
            except PoolFull:  # none elsewhere: the free pages around it, with its own
                return self._grow_down(extent, pages, used)
        source, target = self.columns(extent), self.columns(moved)
        with torch.inference_mode():
            for arena in (*self.keys, *self.values):
                arena[:, target.start : target.start + used] = arena[:, source.start : source.start + used]
        self.free(extent)
        self.relocations += 1
        return moved

    def _grow_down(self, extent: Extent, pages: int, used: int) -> Extent:
        """`grow` where no free run elsewhere is long enough, but the free pages right before
        and after the extent, with its own, are: its entries move down into those before
        (`_move_down`). PoolFull if those pages are too few."""
        start = self.allocator.around(extent.start, extent.pages, pages)
        self._move_down(extent.start, start, used, extent.pages)
        return Extent(start, pages)

    def _move_down(self, source_page: int, target_page: int, used: int, pages: int) -> None:
        """Copies the first `used` entries of the extent of `pages` pages at `source_page` down
        to `target_page`, in steps no longer than the move (no entry is overwritten before it is
        copied), and zeroes the old extent's columns from the copy's end on: free pages read as
        zeros."""
        if target_page >= source_page:
            return
        source, target = source_page * self.page_tokens, target_page * self.page_tokens
        with torch.inference_mode():
            for arena in (*self.keys, *self.values):
                for offset in range(0, used, source - target):
                    count = min(source - target, used - offset)
                    arena[:, target + offset : target + offset + count] = arena[
                        :, source + offset : source + offset + count
                    ]
        self._zero(slice(max(source, target + used), source + pages * self.page_tokens))
        self.relocations += 1

    def compact(self, holdings: list[Holding], pages: int = 0) -> bool:
        """Makes the free pages contiguous where no run is long enough though enough pages are free
        (growth by doubling, sessions ended between others): each of these holdings (of sessions
        no pass runs or is set up to run, of prefix blocks) gives back the pages past its entries
        and, lowest first, moves to the lowest free run that holds it (one copy of its entries, on
        a GPU device to device); others stay. Whether a page was freed or an extent moved (nothing
        is where no run of `pages` could come of it)."""
        holdings = sorted((h for h in holdings if not h.released), key=lambda h: h.extent.start)
        if self.allocator.free_pages + sum(h.extent.pages - self.pages_for(max(h.lengths)) for h in holdings) < pages:
            return False
        changed = False
        for holding in holdings:
            used = max(holding.lengths)
            extent, keep = holding.extent, self.pages_for(used)
            if keep < extent.pages:
                self.free(Extent(extent.start + keep, extent.pages - keep))
                extent, changed = Extent(extent.start, keep), True
            start = self.allocator.move_down(extent.start, extent.pages)
            if start != extent.start:
                self._move_down(extent.start, start, used, extent.pages)
                extent, changed = Extent(start, extent.pages), True
            holding.extent = extent
        return changed

    def free(self, extent: Extent) -> None:
        """Gives the extent's pages back, zeroed: nothing a later owner reads can be stale."""
        self._zero(self.columns(extent))
        self.allocator.free(extent.start, extent.pages)

    def _zero(self, columns: slice) -> None:
        """Zeroes these columns of every arena. On CPU whole system pages go back to the system
        (MADV_DONTNEED: private anonymous memory reads zeros after it), so a pool's resident
        size follows what sessions hold."""
        with torch.inference_mode():
            arenas = (arena for layer in zip(self.keys, self.values) for arena in layer)  # as _memory is built
            for arena, memory in zip(arenas, self._memory, strict=True):
                span = (columns.stop - columns.start) * arena.shape[2] * arena.element_size()  # bytes per head
                if memory is None or span < 2 * mmap.PAGESIZE:
                    # No whole page worth a system call per head: one write of zeros for all.
                    arena[:, columns].zero_()
                    continue
                for head in range(arena.shape[0]):
                    self._release(arena, memory, head, columns)

    @staticmethod
    def _release(arena: torch.Tensor, memory: mmap.mmap, head: int, columns: slice) -> None:
        """Zeroes one head's columns of a CPU arena: the whole system pages inside them by
        handing them back, the partial pages at either end by writing zeros."""
        row = arena.shape[1] * arena.shape[2] * arena.element_size()  # bytes of one head
        per_token = arena.shape[2] * arena.element_size()
        begin, end = head * row + columns.start * per_token, head * row + columns.stop * per_token
        first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            arena[head, columns].zero_()
            return
        memory.madvise(mmap.MADV_DONTNEED, first, last - first)
        arena[head, columns.start : columns.start + -(-(first - begin) // per_token)].zero_()
        arena[head, columns.start + (last - begin) // per_token : columns.stop].zero_()


@dataclass(frozen=True)
class Extent:
    start: int  # first page
    pages: int


class Holding:
    """What one cache holds of a pool: its extent and how many entries each layer has there.
    Layers point here, never at their cache, so a cache no one refers to any more is freed at
    once (no reference cycle for the collector to find), and its extent with it."""

    def __init__(self, pool: KVPool, extent: Extent) -> None:
        self.pool, self.extent = pool, extent
        self.lengths = [0] * len(pool.keys)
        self.released = False

    def columns(self, tokens: int, offset: int = 0) -> slice:
        """The arena columns of entries [offset, tokens)."""
        start = self.extent.start * self.pool.page_tokens
        return slice(start + offset, start + tokens)

    def reserve(self, tokens: int) -> None:
        if self.released:
            raise RuntimeError("this pool cache was released; its extent belongs to another session")
        if tokens > self.extent.pages * self.pool.page_tokens:
            self.extent = self.pool.grow(self.extent, tokens, max(self.lengths))

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.free(self.extent)


class PoolLayer(CacheLayerMixin):
    """One layer of a PoolCache: its `length` entries sit at the start of the cache's extent."""

    is_compileable = False
    is_sliding = False

    def __init__(self, holding: Holding, index: int) -> None:
        super().__init__()
        self._holding, self._index = holding, index
        self.device = holding.pool.device
        self.is_initialized = True

    @property
    def length(self) -> int:
        return self._holding.lengths[self._index]

    @property
    def keys(self) -> torch.Tensor:  # [1, H, length, D], a view
        return self._holding.pool.keys[self._index][:, self._holding.columns(self.length)].unsqueeze(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None
            raise AttributeError("a pool layer's keys are written by update(), not assigned")

    @property
    def values(self) -> torch.Tensor:  # [1, H, length, D], a view
        return self._holding.pool.values[self._index][:, self._holding.columns(self.length)].unsqueeze(0)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None
            raise AttributeError("a pool layer's values are written by update(), not assigned")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the arenas exist from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes a pass's new entries [1, H, N, D] after the layer's own, in place; returns the
        [1, H, length + N, D] views attention reads."""
        holding = self._holding
        if key_states.shape[0] != 1:
            raise ValueError(f"a pool cache holds one sequence; the pass has {key_states.shape[0]}")
        if key_states.dtype != holding.pool.dtype:
            raise TypeError(f"the pool holds {holding.pool.dtype}; the pass computed {key_states.dtype}")
        start, new = self.length, key_states.shape[-2]
        holding.reserve(start + new)
        columns = holding.columns(start + new, start)
        holding.pool.keys[self._index][:, columns] = key_states[0]
        holding.pool.values[self._index][:, columns] = value_states[0]
        holding.lengths[self._index] = start + new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows (PoolCache.reserve)

    def crop(self, max_length: int) -> None:
        """DynamicLayer.crop's meaning: keep `max_length` entries, or drop -`max_length`."""
        keep = self.length + max_length if max_length < 0 else min(max_length, self.length)
        self._holding.lengths[self._index] = max(keep, 0)

    def reset(self) -> None:
        self._holding.lengths[self._index] = 0


class PoolCache(Cache):
    """A session's KV: the first `lengths[layer]` entries of its extent in every layer. Its
    extent goes back to the pool when nothing refers to the cache any more (a session dropped
    by the store while a call still runs it keeps its entries until that call is done), or at
    `release`."""

    def __init__(self, pool: KVPool, extent: Extent) -> None:
        self.pool = pool
        self._holding = Holding(pool, extent)
        self._finalizer = weakref.finalize(self, self._holding.release)
        super().__init__(layers=[PoolLayer(self._holding, index) for index in range(len(pool.keys))])

    @property
    def extent(self) -> Extent:
        return self._holding.extent

    @property
    def lengths(self) -> list[int]:
        return self._holding.lengths

    @property
    def released(self) -> bool:
        return self._holding.released

    @property
    def reserved_tokens(self) -> int:
        return self.extent.pages * self.pool.page_tokens

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_tokens * self.pool.bytes_per_token

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries it holds, over every layer (what its views' nbytes sum to)."""
        return sum(self.lengths) * self.pool.bytes_per_token // len(self.lengths)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` entries in every layer (PoolFull if the pool has none), before a
        pass writes them: a pass never fails halfway through its layers for want of room."""
        self._holding.reserve(tokens)

    def load(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Holds exactly these entries, per layer (keys, values) [1, H, L, D], in its extent (a
        batched pass's row handed back, the prefix cache's blocks): one copy of each."""
        length = layers[0][0].shape[-2]
        self.reserve(length)
        columns = self._holding.columns(length)
        with torch.inference_mode():
            for index, (keys, values) in enumerate(layers):
                self.pool.keys[index][:, columns] = keys[0]
                self.pool.values[index][:, columns] = values[0]
        self._holding.lengths[:] = [length] * len(layers)

    def fork(self, tokens: int) -> PoolCache:
        """A cache of its own holding this one's first `tokens` entries (all, if it has fewer),
        copied into a new extent: the two write apart from then on. PoolFull if none is free."""
        child = self.pool.open(max(tokens, 1))
        kept = [min(tokens, length) for length in self.lengths]
        source, target = self._holding.columns(max(kept)), child._holding.columns(max(kept))
        with torch.inference_mode():
            for arena in (*self.pool.keys, *self.pool.values):
                arena[:, target] = arena[:, source]
        child._holding.lengths[:] = kept
        return child

    def __deepcopy__(self, memo: dict) -> PoolCache:
        """A copy in an extent of its own (copy.deepcopy of a session): the arenas are shared."""
        return self.fork(max(self.lengths))

    def keep_path(self, committed: int, path: list[int]) -> None:
        """specdec.engine.tree_pass.keep_tree_path in the extent: node path[j]'s entries (at
        committed + path[j] − 1) move down to committed + j, then the rest is dropped."""
        if path:
            start = self._holding.columns(committed).stop
            source = torch.tensor([start + node - 1 for node in path], dtype=torch.long, device=self.pool.device)
            with torch.inference_mode():
                for arena in (*self.pool.keys, *self.pool.values):
                    arena[:, start : start + len(path)] = arena.index_select(1, source)
        self._holding.lengths[:] = [min(length, committed + len(path)) for length in self.lengths]

    def release(self) -> None:
        """Gives the extent back to the pool now; the cache is unusable after."""
        self._finalizer()


def compact(caches: list, pages: int = 0, blocks: list[Holding] | None = None) -> bool:
    """KVPool.compact over these caches' pool holdings (other kinds skipped) and a prefix cache's `blocks`."""
    holdings = [*(cache._holding for cache in caches if isinstance(cache, PoolCache)), *(blocks or ())]
    if not holdings:
        return False
    pool = holdings[0].pool
    return pool.compact([holding for holding in holdings if holding.pool is pool], pages)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model's KV cache, from its transformers config."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads
