"""Tree proposals (ProposeRequest.tree_widths): every node at depth d gets tree_widths[d]
children, grown a level per pass with a tree mask, each child sent with the distribution it
was drawn from, so the target verifies the whole tree exactly (specdec.sampling.tree_sampling).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from draft_service.drafter import Proposal, ProposeCall
from specdec.engine.calls import check_trees
from specdec.errors import InvalidArgument
from specdec.sampling.probs import RowSupport, logits_to_probs, sample, support_of, top_k_parts
from specdec.sampling.transfer import fetch
from specdec.sampling.tree_sampling import MAX_TREE_NODES, tree_size

if TYPE_CHECKING:
    from draft_service.stepping import DraftStepper


def propose_tree(runner: DraftStepper, call: ProposeCall) -> Proposal:
    """A token tree: every node at depth d gets tree_widths[d] children, grown a level per
    pass (the root's pass, then each level but the last on top of the cached levels above,
    with a tree mask: specdec.engine.tree_pass). Nodes come in level order.

    Why the target can verify it exactly (specdec.sampling.tree_sampling): a node's children are
    independent draws, each sent with the distribution it was drawn from. Sampled, they
    are i.i.d. from the node's distribution (with replacement, so siblings may repeat);
    deterministic (greedy), they are the node's top tokens, each sent one-hot. The levels
    stay cached behind the session's sequence, which remains the committed one; the next
    call keeps the branch its new tokens spell out (KVSession.tree). Trees take no copies
    and no confidence stop.
    """
    widths = check_tree_widths(call, runner.max_speculative_tokens)
    check_trees(runner.trees, runner.loaded.model_id)  # before the session opens
    session, pending, deterministic, generator, clock = runner._open(call, len(widths))
    frontier = [(0, runner.forward(session, pending, logits_to_keep=1)[-1])]  # (node, logits [N_head])
    processed = len(pending)
    token_ids: list[int] = []  # the model's ids (what the tree pass runs)
    proposed: list[int] = []  # the caller's
    parents: list[int] = []
    rows: list[torch.Tensor] = []  # per node, the distribution it was drawn from: [V]
    supports: list[RowSupport | None] = []
    for depth, width in enumerate(widths):
        first = len(token_ids) + 1
        level = draw_level(
            runner, call, torch.stack([logits for _, logits in frontier]), width, deterministic, generator
        )
        for (node, _), (chosen, head_probs, support) in zip(frontier, level):
            row = None if head_probs is None else runner._over_vocab(head_probs)  # [V]
            mapped = runner._caller_support(support)
            for head_row in chosen:
                token_ids.append(runner._model_id(head_row))
                proposed.append(runner._caller_id(head_row))
                parents.append(node)
                if row is not None:
                    rows.append(row)
                    supports.append(mapped)
        if depth + 1 < len(widths):  # the last level's nodes have no children to draw
            logits_by_node = runner.forward_tree(session, [], token_ids, parents, first_node=first)  # [R, N_head]
            frontier = list(zip(range(first, len(token_ids) + 1), logits_by_node))
            processed += len(logits_by_node)
    return Proposal(
        token_ids=proposed,
        probs=None if deterministic else torch.stack(rows),  # [N, V]
        deterministic=deterministic,
        processed_tokens=processed,
        sequence_length=runner._caller_length(session),
        compute_ms=clock.ms(),
        supports=None if deterministic else supports,
        parents=parents,
    )


def draw_level(
    runner: DraftStepper,
    call: ProposeCall,
    logits: torch.Tensor,  # [F, N_head]: each node of the level's frontier
    width: int,
    deterministic: bool,
    generator: np.random.Generator,
) -> list[tuple[list[int], torch.Tensor | None, RowSupport | None]]:
    """Each frontier node's `width` children (head rows), with the row they were drawn from
    ([N_head], None when deterministic) and its entries: the level's draws cross from the
    device in one transfer. Deterministic, a node's top tokens by logit (the softmax keeps the
    order), only finite ones; sampled, i.i.d. draws from its distribution, node after node from
    the call's generator."""
    checked = logits
    if call.vocab_limit:
        logits = runner._below(logits, call.vocab_limit)
    if deterministic:
        top = logits.topk(min(width, logits.shape[-1]), dim=-1)  # [F, w]
        total, ids, finite = fetch(checked.sum(), top.indices, torch.isfinite(top.values))
        if not math.isfinite(total[0]):
            runner.check_logits(checked, call.session_id)
        count = top.indices.shape[1]
        return [
            ([int(i) for i, kept in zip(ids[f * count : (f + 1) * count], finite[f * count :]) if kept], None, None)
            for f in range(logits.shape[0])
        ]
    head_probs, parts = top_k_parts(logits_to_probs(logits, call.params), runner.proposal_top_k)  # [F, N], [F, 2k + 1]
    draws = sample(head_probs.repeat_interleave(width, dim=0), generator)  # [F * width]: i.i.d. per node
    total, drawn, *fetched = fetch(checked.sum(), draws, *(() if parts is None else (parts,)))
    if not math.isfinite(total[0]):
        runner.check_logits(checked, call.session_id)
    span = 0 if parts is None else parts.shape[1]
    return [
        (
            [int(i) for i in drawn[f * width : (f + 1) * width]],
            head_probs[f],
            support_of(fetched[0][f * span : (f + 1) * span]) if fetched else None,
        )
        for f in range(logits.shape[0])
    ]


def check_tree_widths(call: ProposeCall, max_speculative_tokens: int) -> tuple[int, ...]:
    """A tree call's shape: widths >= 1, a depth within max_speculative_tokens, at most
    MAX_TREE_NODES nodes, and no chain length or copies beside it."""
    widths = call.tree_widths
    if call.num_tokens or call.max_copied_tokens:
        raise InvalidArgument("a tree proposal (tree_widths) takes num_tokens 0 and no max_copied_tokens")
    if any(width < 1 for width in widths) or len(widths) > max_speculative_tokens:
        raise InvalidArgument(
            f"tree_widths {list(widths)}: each width must be >= 1 and the depth at most {max_speculative_tokens}"
        )
    if tree_size(widths) > MAX_TREE_NODES:
        raise InvalidArgument(f"tree_widths {list(widths)} make {tree_size(widths)} nodes; at most {MAX_TREE_NODES}")
    return widths
