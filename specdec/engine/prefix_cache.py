"""KV blocks of earlier sessions' prompts, kept for the next session that starts the same way.

A multi-turn chat re-sends its whole conversation every turn, and requests share system
prompts; without this cache both model services prefill all of it every time. Blocks are
`block_tokens` long and keyed by a hash chain over the namespace and every token up to the
block's end, so a block is found only after every block before it (as vLLM's automatic prefix
caching keys them). Each block also keeps its tokens and its parent's key, and a lookup
compares them: a hash collision can never hand a session another sequence's entries.

Exactness. A cached block must hold exactly what a fresh prefill would compute, or a cache hit
could change an output. A pass's float results depend on its shape (a 300-token prefill's
first 256 entries differ in the last bits from a 256-token prefill's on these CPUs), so a
service with this cache on prefills every session in passes of exactly one block, aligned to
absolute positions (ModelRunner._prefill_blocks): block j is then always computed the same way,
on top of the same blocks 0..j-1, whether they came from this cache or not. Only such blocks
are cached (`KVSession.aligned_tokens`); tokens a session ran in verify or draft passes are not.

Not thread-safe: the owning SessionStore is driven by one model thread (the metrics thread
only reads counters).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from specdec.engine.kv import plain_cache
from specdec.engine.kv_pool import Extent, Holding, PoolCache, PoolFull

# Tokens per block (ModelServiceConfig.prefix_block_tokens, a fixed value). Prefilling in
# aligned blocks costs extra passes: a 512-token int8 1.5B prefill took 1.46 s in 256-token
# passes, 1.53 s in 128, 1.60-1.72 s in 64 and 1.92-1.94 s in 32 (1.96 s in one pass), on a
# 2-core AVX-512 EPYC.
DEFAULT_PREFIX_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Block:
    """A cached block: its tokens, its parent's key, and its entries, either pages of the pool
    the session it came from sits in (`holding`: so the pool holds all of a service's KV, and
    a CUDA device no more than the budget) or tensors of its own (models outside a pool)."""

    parent: bytes  # the previous block's key (b"" for a namespace's first block)
    token_ids: tuple[int, ...]  # [block_tokens]
    tensors: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # per layer (keys, values): [1, H, block_tokens, D]
    holding: Holding | None = None  # its pages (one block's worth), entries at their start

    @property
    def layers(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per layer (keys, values) [1, H, block_tokens, D]: of a pooled block, views of its pages."""
        if self.holding is None:
            return self.tensors
        pool, columns = self.holding.pool, self.holding.columns(len(self.token_ids))
        return tuple((k[:, columns].unsqueeze(0), v[:, columns].unsqueeze(0)) for k, v in zip(pool.keys, pool.values))

    @property
    def nbytes(self) -> int:
        return sum(keys.nbytes + values.nbytes for keys, values in self.layers)

    def release(self) -> None:
        """Its pages back to the pool (tensors go with the block)."""
        if self.holding is not None:
            self.holding.release()


def block_key(parent: bytes, namespace: str, token_ids: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(namespace.encode())
    digest.update(b"\0")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class PrefixCache:
    """Blocks by key, least recently used first, within `max_bytes`.

    A lookup or insert touches a chain's blocks last-to-first, so a parent is always more
    recent than its children and eviction takes leaves first: no cached block is ever
    unreachable behind an evicted parent for long.
    """

    def __init__(self, block_tokens: int, max_bytes: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1; got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.lookups = 0  # sessions that asked
        self.hits = 0  # of those, sessions that started from at least one block
        self.tokens_saved = 0  # tokens a hit spared a prefill
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def figures(self) -> tuple[int, int, int, int, int, int]:
        """(bytes, max_bytes, block_tokens, lookups, hits, tokens_saved): ModelInfo.prefix_cache."""
        return (self.bytes, self.max_bytes, self.block_tokens, self.lookups, self.hits, self.tokens_saved)

    def _chain(self, namespace: str, token_ids: list[int], blocks: int):
        """(key, parent, block tokens) for the first `blocks` full blocks of `token_ids`."""
        parent = b""
        size = self.block_tokens
        for start in range(0, blocks * size, size):
            chunk = tuple(token_ids[start : start + size])
            key = block_key(parent, namespace, chunk)
            yield key, parent, chunk
            parent = key

    def lookup(self, namespace: str, token_ids: list[int], max_tokens: int) -> DynamicCache | None:
        """A cache of the longest run of cached blocks that `token_ids` starts with, covering
        at most `max_tokens` tokens (the caller needs logits of the rest), or None."""
        self.lookups += 1
        found: list[bytes] = []
        for key, parent, chunk in self._chain(namespace, token_ids, max(max_tokens, 0) // self.block_tokens):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.token_ids != chunk:
                break
            found.append(key)
        if not found:
            return None
        self._touch(found)
        blocks = [self._blocks[key].layers for key in found]  # a pooled block's views, made once
        layers = [
            (
                torch.cat([block[index][0] for block in blocks], dim=2),  # [1, H, n · block_tokens, D]
                torch.cat([block[index][1] for block in blocks], dim=2),
            )
            for index in range(len(blocks[0]))
        ]
        return plain_cache(layers)  # the concatenated blocks: tensors of its own

    def started(self, tokens: int) -> None:
        """A session started from `tokens` of a hit (counted here, not at `lookup`: a session
        with no room for the blocks is refused, and starts from nothing)."""
        self.hits += 1
        self.tokens_saved += tokens

    def insert(self, namespace: str, token_ids: list[int], cache: Cache, aligned_tokens: int) -> int:
        """Copies the full blocks among the first `aligned_tokens` entries of `cache` (which
        hold `token_ids`' KV) that are not held yet; returns how many it added. Stops at the
        first block that will not fit `max_bytes` after evicting older blocks."""
        added, chain = 0, []
        layers: list = cache.layers  # full-attention layers: ModelRunner refuses a cache of any other kind
        size = self.block_tokens  # every block's bytes, the first's
        nbytes = sum(layer.keys[:, :, :size].nbytes + layer.values[:, :, :size].nbytes for layer in layers)
        for index, (key, parent, chunk) in enumerate(
            self._chain(namespace, token_ids, aligned_tokens // self.block_tokens)
        ):
            chain.append(key)
            if key in self._blocks:
                continue
            start = index * self.block_tokens
            short = nbytes - (self.max_bytes - self.bytes)
            fits = short <= 0 or self.evict(short, keep=set(chain)) >= short
            block = self._cut(parent, chunk, cache, start, set(chain)) if fits else None
            if block is None:  # over max_bytes, or no page free and no older block to give one up
                chain.pop()
                break
            self._blocks[key] = block
            self.bytes += block.nbytes
            added += 1
        self._touch(chain)
        return added

    def _cut(self, parent: bytes, chunk: tuple[int, ...], cache: Cache, start: int, keep: set[bytes]) -> Block | None:
        """The block of `cache`'s entries [start, start + block_tokens): copied into a page of its
        pool where a page holds a block (taking one from the least recently used blocks not in
        `keep` where none is free; None where none can be), else into tensors of its own."""
        end = start + self.block_tokens
        layers: list = cache.layers
        if not isinstance(cache, PoolCache) or cache.pool.page_tokens != self.block_tokens:
            tensors = tuple((lr.keys[:, :, start:end].clone(), lr.values[:, :, start:end].clone()) for lr in layers)
            return Block(parent, chunk, tensors)
        pool = cache.pool
        while True:
            try:
                holding = Holding(pool, Extent(pool.allocator.alloc(1), 1))
                break
            except PoolFull:
                if not self.evict_pages(1, keep):
                    return None
        holding.lengths[:] = [self.block_tokens] * len(layers)
        columns = holding.columns(self.block_tokens)
        with torch.inference_mode():
            for index, layer in enumerate(layers):
                pool.keys[index][:, columns] = layer.keys[0, :, start:end]
                pool.values[index][:, columns] = layer.values[0, :, start:end]
        return Block(parent, chunk, holding=holding)

    def holdings(self) -> list[Holding]:
        """The pool pages the blocks hold (KVPool.compact moves them as it moves sessions)."""
        return [block.holding for block in self._blocks.values() if block.holding is not None]

    def evict(self, needed_bytes: int, keep: frozenset[bytes] | set[bytes] = frozenset()) -> int:
        """Drops least recently used blocks (not in `keep`) until `needed_bytes` are freed or
        none is left; returns the bytes freed."""
        freed = 0
        for key in list(self._blocks):
            if freed >= needed_bytes:
                break
            if key not in keep:
                freed += self._drop(key)
        return freed

    def evict_pages(self, pages: int, keep: frozenset[bytes] | set[bytes] = frozenset()) -> int:
        """Drops least recently used blocks (not in `keep`) that sit in pool pages, a page each,
        one at least and then until their pool has `pages` pages free; returns how many."""
        dropped = 0
        for key in [key for key, block in self._blocks.items() if block.holding is not None and key not in keep]:
            holding = self._blocks[key].holding
            if dropped and holding is not None and holding.pool.allocator.free_pages >= pages:
                break
            self._drop(key)
            dropped += 1
        return dropped

    def _drop(self, key: bytes) -> int:  # → the bytes it held
        block = self._blocks.pop(key)
        self.bytes -= block.nbytes
        self.evicted_blocks += 1
        block.release()
        return block.nbytes

    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def clear(self) -> None:
        for block in self._blocks.values():
            block.release()
        self._blocks.clear()
        self.bytes = 0
