"""The cache a static pass (specdec.engine.static_pass) hands the model: each layer writes the
pass's new entries into the KV pool's arenas in place and reads its sessions' entries back as
one gather, at slots and columns the pass computes on the device."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.engine.kv_pool import KVPool


class PassLayer(CacheLayerMixin):
    """A layer of the static pass's cache: writes the pass's new entries at the pass's slots in
    the pool's arenas and returns its sessions' entries gathered at the pass's columns."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: PassCache, index: int) -> None:
        super().__init__()
        self._cache, self._index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [B, H, N, D] → the sessions' entries [B, H, L, D] (gathered)."""
        cache = self._cache
        batch, heads, tokens, dim = key_states.shape
        out = []
        for arena, states in (
            (cache.pool.keys[self._index], key_states),
            (cache.pool.values[self._index], value_states),
        ):
            arena.index_copy_(1, cache.slots, states.transpose(0, 1).reshape(heads, batch * tokens, dim))
            gathered = arena.index_select(1, cache.columns)  # [H, B·L, D]
            out.append(gathered.view(heads, batch, -1, dim).transpose(0, 1))  # [B, H, L, D]
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.length, 0

    def get_seq_length(self) -> int:
        return 0  # positions and the mask are given: never read

    def get_max_length(self) -> int:
        return -1


class PassCache(Cache):
    """The cache a static pass hands the model: the pool's arenas, and the pass's slots and
    columns (static buffers under a CUDA graph)."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, columns: torch.Tensor, length: int) -> None:
        self.pool, self.slots, self.columns, self.length = pool, slots, columns, length
        super().__init__(layers=[PassLayer(self, index) for index in range(len(pool.keys))])
