"""One forward pass over a token tree on top of a session's KV cache, and keeping only the
accepted path afterwards (the target verifies a tree in one such pass; the draft grows one a
level per pass).

Numbering as in specdec.sampling.tree_sampling: node 0 is the last committed token, nodes 1..N the
draft tree, `parents[i-1]` < i, and node i's cache entry sits at (committed length) + i − 1.
The pass feeds the committed tokens the cache has not seen (`new_tokens`, causal among
themselves, the last one being node 0) followed by the nodes not cached yet; each node
attends to the committed past and its own ancestors and itself, through a 4D additive mask,
at position (committed length) + depth − 1. Its logits are then those of a plain forward
over the committed sequence plus its root-to-node path (float32: to ~1e-7; tested; with the
row-wise attention of specdec.engine.attention, bitwise those of one-token passes), so one pass
scores every branch.

After the decision the cache holds the nodes; `keep_tree_path` gathers the entries of the
accepted path behind the committed prefix (a gather, not a crop: the path's nodes need not be
contiguous), so the cache is again exactly that of the committed sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from specdec.engine.kv_pool import PoolCache
from specdec.engine.modeling import with_cache
from specdec.sampling.tree_sampling import ancestors


@dataclass(frozen=True)
class CachedTree:
    """Token-tree nodes a pass left in a session's cache behind its sequence (a tree verify,
    or the levels a tree proposal ran). The next call keeps those on the path its new tokens
    spell out, so a round that accepted a branch runs none of it again."""

    start: int  # the session's sequence length; node i's entry sits at start + i − 1
    token_ids: tuple[int, ...]  # [N]
    parents: tuple[int, ...]  # [N]
    cached_nodes: int  # nodes 1..M are in the cache

    def path(self, tokens: list[int]) -> list[int]:
        """The cached nodes whose root-to-node tokens are a prefix of `tokens`. Siblings with
        the same token (i.i.d. children) have the same entries, so the first one serves."""
        node, path = 0, []
        for token in tokens:
            child = next(
                (
                    c
                    for c in range(node + 1, self.cached_nodes + 1)
                    if self.parents[c - 1] == node and self.token_ids[c - 1] == token
                ),
                None,
            )
            if child is None:
                break
            path.append(child)
            node = child
        return path


def tree_attention_mask(
    paths: list[list[int]], past: int, num_new: int, dtype: torch.dtype = torch.float32, first_node: int = 1
) -> torch.Tensor:
    """[1, 1, num_new + R, past + num_new + N] additive mask. Rows: the new committed tokens
    (causal), then nodes first_node..N (R of them); columns: the committed past, the new
    tokens and nodes 1..N; 0 where a row may attend, the dtype's minimum
    elsewhere. Each node sees the committed tokens and its root-to-node path (`paths`, from
    specdec.sampling.tree_sampling.ancestors). `past` counts committed entries only."""
    num_nodes, ran = len(paths), len(paths) - first_node + 1
    base = past + num_new  # node i's column: base + i − 1
    rows, columns = num_new + ran, base + num_nodes
    allowed = torch.zeros(rows, columns, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:num_new, past:base] = torch.ones(num_new, num_new, dtype=torch.bool).tril()
    allowed[num_new:, past:base] = True
    for row, path in enumerate(paths[first_node - 1 :]):
        allowed[num_new + row, [base + node - 1 for node in path]] = True
    zero, blocked = torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, zero, blocked)[None, None]


def tree_position_ids(paths: list[list[int]], past: int, num_new: int, first_node: int = 1) -> torch.Tensor:
    """[1, num_new + R]: the new tokens at past.., each node run at its depth below the last one."""
    base = past + num_new
    return torch.tensor([[*range(past, base), *(base + len(path) - 1 for path in paths[first_node - 1 :])]])


@torch.inference_mode()
def tree_forward(
    model: torch.nn.Module,
    cache: Cache,
    new_tokens: Sequence[int],
    token_ids: Sequence[int],
    parents: Sequence[int],
    first_node: int = 1,
) -> torch.Tensor:
    """Runs `new_tokens`, then nodes first_node..N; nodes 1..first_node − 1 must be the
    cache's last entries already (an earlier level's pass: the draft grows a tree this way).

    Returns logits [1 + R, V] when `new_tokens` is given (row 0 predicts the tree's first
    level, row j the children of node first_node + j − 1), else [R, V] for the R nodes run.
    The root (node 0) is the last committed token: the last of `new_tokens`, or else the
    cache's last committed entry."""
    if not new_tokens and cache.get_seq_length() - (first_node - 1) < 1:
        raise ValueError("nothing is committed: a tree needs the last committed token as its root")
    if first_node > 1 and new_tokens:
        raise ValueError("new committed tokens cannot follow tree nodes already in the cache")
    if not 1 <= first_node <= len(token_ids):
        raise ValueError(f"first_node {first_node} is outside the tree's nodes 1..{len(token_ids)}")
    paths = ancestors(parents)
    past = cache.get_seq_length() - (first_node - 1)  # committed entries
    dtype = next(model.parameters()).dtype
    mask = tree_attention_mask(
        paths, past, len(new_tokens), dtype if dtype.is_floating_point else torch.float32, first_node
    )
    # The row-wise attention (specdec.engine.attention) reads a float mask as a tree's visibility.
    device = next(model.parameters()).device
    positions = tree_position_ids(paths, past, len(new_tokens), first_node).to(device)
    input_ids = torch.tensor([[*new_tokens, *token_ids[first_node - 1 :]]], device=device)
    mask = mask.to(device)
    logits = model(input_ids, **with_cache(model, cache), attention_mask=mask, position_ids=positions).logits[0]
    return logits[max(len(new_tokens) - 1, 0) :]  # [1 + R, V] or [R, V]


@torch.inference_mode()  # the cache's tensors are inference tensors: updated in place in that mode only
def keep_tree_path(cache: Cache, committed: int, path: Sequence[int]) -> None:
    """Keeps the first `committed` entries (the sequence before the tree) and the entries of
    the accepted `path` nodes, in order; drops the other nodes. The cache must hold the
    sequence before the tree followed by at least the path's nodes (in node order).

    Only the tail moves: each path entry is copied down to its place (node path[j], at
    committed + path[j] − 1, goes to committed + j, never above its source, and every later
    source lies above this destination), then the cache is cut after it."""
    if isinstance(cache, PoolCache):
        cache.keep_path(committed, list(path))  # the same gather, in the session's extent
        return
    kept = committed + len(path)
    source = torch.tensor([committed + node - 1 for node in path], dtype=torch.long)  # [len(path)]
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            raise TypeError(f"{type(layer).__name__} holds no key/value tensors to gather")
        if len(path):
            source = source.to(keys.device)
            keys[..., committed:kept, :] = keys.index_select(-2, source)
            values[..., committed:kept, :] = values.index_select(-2, source)
        layer.keys = keys[..., :kept, :]  # type: ignore[union-attr]
        layer.values = values[..., :kept, :]  # type: ignore[union-attr]
