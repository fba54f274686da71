"""One forward pass over a token tree on top of a session's KV cache, and keeping only the
accepted path afterwards (issue 19's model side; not wired into the runners yet).

Numbering as in specdec.tree_sampling: node 0 is the last committed token, nodes 1..N the
draft tree, `parents[i-1]` < i. The pass feeds the committed tokens the cache has not seen
(`new_tokens`, causal among themselves, the last one being node 0) followed by the N nodes;
each node attends to the whole past, all of `new_tokens`, and its own ancestors and itself,
through a 4D additive mask, at position past + len(new_tokens) + depth − 1. Its logits are
then those of a plain forward over the committed sequence plus its root-to-node path
(float32: to ~1e-7; tested), so one pass scores every branch.

After the decision the cache holds all N nodes; `keep_tree_path` gathers the entries of the
accepted path behind the committed prefix (a gather, not a crop: the path's nodes need not be
contiguous), so the cache is again exactly that of the committed sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdec import attention
from specdec.tree_sampling import ancestors


def tree_attention_mask(
    paths: list[list[int]], past: int, num_new: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[1, 1, num_new + N, past + num_new + N] additive mask: 0 where a row may attend, the
    dtype's minimum elsewhere. Rows: the new committed tokens (causal), then the nodes, each
    seeing its root-to-node path (`paths`, from specdec.tree_sampling.ancestors)."""
    num_nodes = len(paths)
    rows, columns = num_new + num_nodes, past + num_new + num_nodes
    allowed = torch.zeros(rows, columns, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:num_new, past : past + num_new] = torch.ones(num_new, num_new, dtype=torch.bool).tril()
    allowed[num_new:, past : past + num_new] = True
    for row, path in enumerate(paths):
        allowed[num_new + row, [past + num_new + node - 1 for node in path]] = True
    zero, blocked = torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, zero, blocked)[None, None]


def tree_position_ids(paths: list[list[int]], past: int, num_new: int) -> torch.Tensor:
    """[1, num_new + N]: the new tokens at past.., each node at its depth below the last one."""
    base = past + num_new
    return torch.tensor([[*range(past, base), *(base + len(path) - 1 for path in paths)]])


@torch.inference_mode()
def tree_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    new_tokens: Sequence[int],
    token_ids: Sequence[int],
    parents: Sequence[int],
) -> torch.Tensor:
    """Logits [N + 1, V]: row 0 predicts the tree's first level (after the last new token),
    row i predicts the children of node i. `new_tokens` must not be empty (it ends in node 0)."""
    if not new_tokens:
        raise ValueError("new_tokens is empty: the pass needs the last committed token as the tree's root")
    if getattr(model.config, "_attn_implementation", None) == attention.NAME:
        # The row-wise attention assumes a causal pass and ignores the mask: a tree's nodes
        # would see their siblings. Tree passes need a mask-honouring implementation (SDPA).
        raise ValueError(f"tree passes need an attention that honours a 4D mask, not {attention.NAME!r}")
    past, paths = cache.get_seq_length(), ancestors(parents)
    dtype = next(model.parameters()).dtype
    mask = tree_attention_mask(paths, past, len(new_tokens), dtype if dtype.is_floating_point else torch.float32)
    positions = tree_position_ids(paths, past, len(new_tokens))
    input_ids = torch.tensor([[*new_tokens, *token_ids]])
    logits = model(input_ids, past_key_values=cache, attention_mask=mask, position_ids=positions).logits[0]
    return logits[len(new_tokens) - 1 :]  # [N + 1, V]


def keep_tree_path(cache: DynamicCache, committed: int, path: Sequence[int]) -> None:
    """Keeps the first `committed` entries (the sequence before the tree) and the entries of
    the accepted `path` nodes, in order; drops the other nodes. The cache must hold exactly
    `committed` + N entries (the pass just run)."""
    keep = torch.tensor([*range(committed), *(committed + node - 1 for node in path)])
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            raise TypeError(f"{type(layer).__name__} holds no key/value tensors to gather")
        layer.keys = keys.index_select(-2, keep)  # type: ignore[union-attr]
        layer.values = values.index_select(-2, keep)  # type: ignore[union-attr]
