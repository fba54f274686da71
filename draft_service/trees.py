"""Tree proposals (ProposeRequest.tree_widths): every node at depth d gets tree_widths[d]
children, grown a level per pass with a tree mask, each child sent with the distribution it
was drawn from, so the target verifies the whole tree exactly (specdec.sampling.tree_sampling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draft_service.drafter import Proposal, ProposeCall
from specdec.engine.calls import check_trees
from specdec.errors import InvalidArgument
from specdec.sampling.probs import logits_to_probs, sample, top_k_with_support
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
    supports: list[torch.Tensor | None] = []
    for depth, width in enumerate(widths):
        first = len(token_ids) + 1
        for node, logits in frontier:
            runner.check_logits(logits, call.session_id)
            if call.vocab_limit:
                logits = runner._below(logits, call.vocab_limit)
            if deterministic:  # the top tokens by logit (the softmax keeps the order), as many as it may propose
                chosen = logits.topk(min(width, int(torch.isfinite(logits).sum()))).indices.tolist()
            else:
                head_probs, support = top_k_with_support(logits_to_probs(logits, call.params), runner.proposal_top_k)
                chosen = sample(head_probs.expand(width, -1), generator).tolist()  # i.i.d.
                row = runner._over_vocab(head_probs)  # [V]
                mapped = runner._caller_support(support)
            for head_row in chosen:
                token_ids.append(runner._model_id(head_row))
                proposed.append(runner._caller_id(head_row))
                parents.append(node)
                if not deterministic:
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
