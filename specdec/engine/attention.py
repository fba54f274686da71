"""Attention that computes each query row on its own, so a token's attention output is bitwise
the same in a K + 1-token verify pass as in a one-token decode pass; and SDPA that reads
grouped KV heads in place under a mask (GROUPED: the static passes').

A fused attention kernel tiles its work by the number of query rows, so row i of a 5-row pass
and the single row of a 1-row pass at the same position sum in different orders: float32
rounding. With an int8 target such differences can cross a quantisation step now and then,
and a greedy speculative run then drifts from the target's own one-token decoding
(docs/design.md, "An int8 target").
Here row j of a pass with past P attends to exactly the keys 0..P + j, sliced from the
cache as a one-token pass at that position reads them, with the same operations; per-token Linear
layers (specdec.engine.quantize) and per-token norms, rotary embeddings and activations then make
the whole pass per-token exact. A padded batch runs the same way under EVERY_ROW, each row
over its own session's keys (`_padded_rowwise`); under NAME it uses transformers' SDPA.

Three forms: NAME takes passes of at most MAX_ROWS rows and leaves longer ones (a prompt's
prefill) to SDPA, which the target runs as a pass of its own (TargetRunner), the same pass
whatever K is; EVERY_ROW takes every unpadded pass, prefills too. With per-token Linear layers
(an int8 target) EVERY_ROW makes a token's cache entries and logits a function of the tokens
before it alone, however the passes were cut: a prefill, a re-prefill after an eviction, a
prefix cache hit (specdec.engine.prefix_cache) and decoding all agree bit for bit. The target
service uses it for every int8 target on CPU.

Each row is one call of torch's fused attention with a one-row query: the call a one-token
pass at that position makes, so a one-token pass costs what SDPA costs. Against one SDPA
pass, an int8 1.5B prefill costs 1.5% more at 40 tokens and 9% more at 250 (2-core AVX-512
EPYC, 2026-11-27; matmul and softmax per row cost 20% and 22% more); long prompts run in
shorter passes (runner.EXACT_PASS_TOKENS), which gains that back from about 400 tokens on.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.engine.rows import MAX_ROWS

NAME = "specdec_rowwise"
EVERY_ROW = "specdec_rowwise_every_row"
# NAME, and a padded batch's rows each over its own keys, as EVERY_ROW reads them: an int8
# draft's, whose batches are decode steps (a long prompt runs alone, under SDPA, which prefills
# a 3,000-token prompt of the 0.5B a third faster than rows do).
BATCHES = "specdec_rowwise_batches"
GROUPED = "specdec_sdpa_grouped"  # SDPA reading grouped KV heads as they are (grouped_sdpa_forward)


def rowwise_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, Hkv, L, D], the cache included
    value: torch.Tensor,  # [B, Hkv, L, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    every_row: bool = False,
    batches: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch, heads, rows, dim = query.shape
    # One unpadded sequence (the runner never pads a lone session): causal by construction.
    # A float mask is a token tree's (specdec.engine.tree_pass): row j sees exactly the keys its
    # mask row allows (the committed past and its ancestors), gathered into the layout a
    # one-token pass over that path has; so does each row of a padded batch (every_row: an
    # int8 target's), over its own session's keys. Causal passes get a boolean mask or none.
    keyed = _keyed(attention_mask, key.shape[2]) if batch == 1 else every_row or batches
    runs = _padded_runs(attention_mask, batch, rows, key.shape[2]) if keyed else None
    if (
        (runs is None and (keyed or batch != 1))
        or (rows > MAX_ROWS and not every_row)
        or dropout
        or kwargs.get("sliding_window")
        and key.shape[2] > kwargs["sliding_window"]
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = dim**-0.5 if scaling is None else scaling
    if runs is not None:
        return _padded_rowwise(query, key, value, runs, scale)
    groups = heads // key.shape[1]
    past = key.shape[2] - rows
    outputs = []
    for row in range(rows):
        # A slice, not a copy: each head's [P + j + 1, D] block is the one a one-token pass
        # reads (the same rows and row stride; only the step between heads differs, which the
        # kernel takes as it is). Copying cost a prefill O(L²) in memory traffic.
        visible = past + row + 1
        # One query row: the call a one-token pass at this position makes, fused (a third
        # cheaper than matmul, softmax and matmul apart), its GQA groups read in place.
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, row : row + 1],  # [1, H, 1, D]
                key[:, :, :visible, :],  # [1, Hkv, P + j + 1, D]
                value[:, :, :visible, :],
                scale=scale,
                enable_gqa=groups > 1,
            )
        )  # [1, H, 1, D]
    out = outputs[0] if rows == 1 else torch.cat(outputs, dim=2)  # [1, H, Q, D]
    return out.transpose(1, 2), None  # [1, Q, H, D]


_last_keyed: tuple[torch.Tensor, int, bool] | None = None


def _keyed(mask: torch.Tensor | None, length: int) -> bool:
    """Whether a lone pass's rows read their keys from `mask` [1, 1, Q, L]: a tree's (float),
    or one with holes (a decode batch's row left alone, its pads kept), whose last row does
    not see every key. A causal pass's last row sees them all. Read once per pass, as
    `_padded_runs` (every layer gets the same mask object)."""
    global _last_keyed
    if mask is None or mask.dtype.is_floating_point:
        return mask is not None
    last = _last_keyed  # one read: another thread's runner may replace it meanwhile
    if last is not None and last[0] is mask and last[1] == length:
        return last[2]
    keyed = not bool(mask[0, 0, -1, :length].all())
    _last_keyed = (mask, length, keyed)
    return keyed


def _padded_rowwise(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,  # [B, Hkv, L, D]
    runs: list[list[KeyRun]],  # [B][Q]: the keys each row sees
    scale: float,
) -> tuple[torch.Tensor, None]:
    """Attention row by row, each row over its own keys as `runs` give them (a lone token
    tree's pass; a padded batch, each row over its own session's keys), laid out as a lone
    one-token pass reads them (a slice; a token tree's ancestors gathered after it), with
    the call such a pass makes. An int8 target's batched pass is then
    per-token exact too, and a session's logits do not depend on the sessions beside it.
    Under SDPA over the padded batch they differed from its lone passes by float32 rounding,
    which int8's per-token quantisation turns into whole steps: greedy outputs of concurrent
    requests flipped about one token in twenty on the real 1.5B target (docs/design.md, "An
    int8 target")."""
    groups = query.shape[1] // key.shape[1]

    def keys(tensor: torch.Tensor, b: int, run: KeyRun) -> torch.Tensor:  # [1, Hkv, S, D]
        start, end, extra = run
        kept = tensor[b : b + 1, :, start:end]  # a slice, as a lone pass reads its past
        return kept if extra is None else torch.cat([kept, tensor[b : b + 1].index_select(2, extra)], dim=2)

    out = torch.cat(
        [
            torch.cat(
                [
                    torch.nn.functional.scaled_dot_product_attention(
                        query[b : b + 1, :, row : row + 1],  # [1, H, 1, D]
                        keys(key, b, run),
                        keys(value, b, run),
                        scale=scale,
                        enable_gqa=groups > 1,
                    )
                    for row, run in enumerate(row_runs)
                ],
                dim=2,
            )
            for b, row_runs in enumerate(runs)
        ]
    )  # [B, H, Q, D]
    return out.transpose(1, 2), None  # [B, Q, H, D]


KeyRun = tuple[int, int, "torch.Tensor | None"]  # keys [start, end), then these ([E], gathered), or None
_last_runs: tuple[torch.Tensor | None, tuple[int, int, int], list[list[KeyRun]] | None] | None = None


def _padded_runs(mask: torch.Tensor | None, batch: int, rows: int, length: int) -> list[list[KeyRun]] | None:
    """Per batch row and query row, the keys a mask [B|1, 1, Q, L] lets it see (boolean: True
    seen; float: 0 seen), as one run and the rest gathered (specdec.engine.batched_pass pads
    each session's past on the left and its new tokens on the right: a causal row's keys are
    one run; a tree's node adds its ancestors). None where a row sees no key, or a float mask
    holds a bias (a value other than 0 and the dtype's least), which SDPA then takes. No mask:
    causal, unpadded. Every layer of a pass gets the same mask object: it is read once per
    pass (the entry holds the mask, so its identity cannot be reused meanwhile)."""
    global _last_runs
    last = _last_runs
    if last is not None and last[0] is mask and last[1] == (batch, rows, length):
        return last[2]
    runs: list[list[KeyRun]] | None
    if mask is None:
        runs = [[(0, length - rows + row + 1, None) for row in range(rows)]] * batch
    elif mask.dim() != 4 or mask.shape[-1] < length:
        runs = None
    else:
        given = mask[:, 0, :, :length].expand(batch, rows, length)  # [B, Q, L]
        seen = given if given.dtype == torch.bool else given == 0
        masked = given.dtype == torch.bool or bool((seen | (given <= torch.finfo(given.dtype).min / 2)).all())
        count = seen.sum(-1)  # [B, Q]
        start = seen.int().argmax(-1)  # [B, Q]: the first key seen
        end = length - seen.flip(-1).int().argmax(-1)  # [B, Q]: past the last
        one_run = (end - start == count).tolist()
        runs = None if not masked or bool((count == 0).any()) else []  # a bias in the mask: SDPA adds it
        for b in range(batch if runs is not None else 0):
            row_runs: list[KeyRun] = []
            for row, (first, last_end, single) in enumerate(zip(start[b].tolist(), end[b].tolist(), one_run[b])):
                if single:
                    row_runs.append((first, last_end, None))
                    continue
                ids = seen[b, row].nonzero().squeeze(-1)  # [S], ascending
                run = int((ids == torch.arange(first, first + len(ids))).int().cumprod(0).sum())
                row_runs.append((first, first + run, ids[run:]))
            runs.append(row_runs)  # type: ignore[union-attr]
    _last_runs = (mask, (batch, rows, length), runs)
    return runs


AttentionInterface.register(NAME, rowwise_attention_forward)
AttentionInterface.register(EVERY_ROW, functools.partial(rowwise_attention_forward, every_row=True))
AttentionInterface.register(BATCHES, functools.partial(rowwise_attention_forward, batches=True))
# The same masks SDPA gets: padded batches read them, or fall back to SDPA, which needs them
# (without a mask function of its own, transformers would build no mask at all for this implementation).
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionMaskInterface.register(EVERY_ROW, sdpa_mask)
AttentionMaskInterface.register(BATCHES, sdpa_mask)


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, N, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,  # [B, Hkv, L, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA, except that with a mask the G query heads of each KV head are folded
    into its rows ([B, Hkv, G·N, D], the mask's rows repeated G times), so keys and values are
    read as they are: given a mask, transformers repeats them G times on CUDA (`repeat_kv`),
    a copy of every gathered entry G times over (×6 for the 1.5B) in every layer of a static
    pass (specdec.engine.static_pass). The same sums per row: SDPA's result (bit for bit on
    CPU; tests/unit/test_static_pass.py)."""
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if groups == 1 or attention_mask is None or dropout or kwargs.get("sliding_window"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    folded = query.reshape(batch, kv_heads, groups * rows, dim)  # head h = kv · G + g → row g · N + n
    mask = attention_mask[:, :, :, :length].expand(batch, 1, rows, length).repeat(1, 1, groups, 1)  # [B, 1, G·N, L]
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None  # [B, N, H, D]


AttentionInterface.register(GROUPED, grouped_sdpa_forward)
AttentionMaskInterface.register(GROUPED, sdpa_mask)
