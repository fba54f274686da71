"""Building KV caches from tensors a caller already holds, without copying them, and the first
entries of one as a cache of its own."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from specdec.engine.kv_pool import PoolCache


def plain_cache(layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache of plain full-attention layers holding these (keys, values) tensors, each
    [B, H, P, D], as they are: no copy.

    `DynamicCache(pairs)` concatenates each pair onto an empty tensor: a copy of every
    entry, and about 5 µs of dispatch a layer (a 16-layer cache took 138 µs to build
    against 4 here, 2-core AMD EPYC). Sharing a tensor with another cache is safe: the model
    adds entries by concatenating into new tensors and a crop takes a view, so no cache
    writes into another's entries (keep_tree_path writes in place only past the committed
    sequence that a fork or a batch row copies)."""
    pairs = list(layers)
    cache = DynamicCache([(None, None)] * len(pairs))
    fresh: list[Any] = cache.layers  # uninitialised DynamicLayers
    for layer, (keys, values) in zip(fresh, pairs):
        # What DynamicLayer.lazy_initialization and a first update would leave.
        layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
    return cache


@torch.inference_mode()  # the cache's tensors are inference tensors
def cache_prefix(cache: Cache, tokens: int) -> Cache:
    """A cache of its own holding the first `tokens` entries of `cache` (all, if it has fewer).

    Plain full-attention layers (`batchable_cache`) hold views of that slice, per layer
    [1, H, P, D] → [1, H, tokens, D]: no copy, as no cache writes into another's entries
    (specdec.engine.kv.plain_cache), and the fork's first pass concatenates them into tensors
    of its own. Any other kind (sliding windows, quantised, offloaded) is deep-copied and
    cropped. That is what makes a fork cheap: a deep copy walks every object of the cache and
    copies the entries the crop then drops."""
    if isinstance(cache, PoolCache):
        return cache.fork(tokens)  # a copy into an extent of its own (PoolFull if none is free)
    layers: list[Any] = cache.layers  # checked below: plain DynamicLayers, or deep-copied
    if batchable_cache(cache) and all(layer.is_initialized for layer in layers):
        return plain_cache((layer.keys[..., :tokens, :], layer.values[..., :tokens, :]) for layer in layers)
    copied = copy.deepcopy(cache)
    surplus = copied.get_seq_length() - tokens
    if surplus > 0:
        copied.crop(-surplus)
    return copied


def batchable_cache(cache: Cache | None) -> bool:
    """Only plain full-attention layers can be padded and split again (not sliding windows,
    quantised or offloaded caches)."""
    if isinstance(cache, PoolCache):
        return True
    return (
        isinstance(cache, DynamicCache)
        and not getattr(cache, "offloading", False)
        and all(type(layer) is DynamicLayer for layer in cache.layers)
    )
