"""Exact acceptance for a tree of draft tokens (issue 19's sampling math): pure functions.

A tree is numbered 0..N: node 0 is the root, the position after the committed sequence, and
node i (1..N) holds draft token `token_ids[i-1]` with parent `parents[i-1]` < i, drawn from
`draft_probs[i-1]`. The children of a node are drawn **independently**, each from the
distribution it is sent with, and are tried in index order. Two ways of growing a tree meet
that premise: children drawn i.i.d. (with replacement) from the draft's distribution at the
node (every sibling sends that same row), and deterministic candidates such as the draft's
top-b tokens, each sent as a one-hot at itself (a point mass is independent of anything).

Multi-step speculative sampling (SpecInfer, Miao et al. 2024, Algorithm 2, where each child
may come from its own small model; with i.i.d. children it is "recursive rejection sampling"
with replacement): at a node with target distribution p and children c_1..c_m, c_i drawn
from q_i, start from r_0 = p; child c_i is *accepted* with probability
min(1, r_{i-1}(c_i) / q_i(c_i)), and on rejection r_i = norm(max(0, r_{i-1} − q_i)).
An accepted child becomes the node and the rule repeats below it; if every child is
rejected, the next token is *recovered* from r_m (for a leaf, m = 0: the *bonus* sample from
p). Why it is exact, by induction over the children: before child i the token still to be
emitted at this node is distributed as r_{i-1} given the rejections so far; child i is an
independent draw from q_i, so one step of ordinary rejection sampling emits c_i with
probability min(r_{i-1}, q_i)(c_i) and leaves r_i after a rejection; summing over the steps
gives exactly p. Independence is required: a child drawn from its node's distribution
conditionally on its siblings (sampling without replacement, yet sent with the node's row)
breaks the step's premise. Distinct top-b candidates are fine when each is sent one-hot: the
rule then tries c_1 with probability p(c_1), else c_2 with p(c_2) / (1 − p(c_1)), and so on.

The split across processes mirrors the chain (specdec.sampling.probs.verify_outputs): r_i depends on
p, q and the number of rejections only, never on which tokens were rejected, so the target
computes every child's r_{i-1}(c_i) and every node's recovered sample from r_m in advance,
from its own generator; the coordinator then walks the tree with its own uniforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.sampling.probs import SparseRows, residual_probs, rows_on, sample

MAX_TREE_NODES = 31  # a tree pass scores N + 1 <= 32 rows: specdec.engine.rows.MAX_ROWS


def tree_size(widths: Sequence[int]) -> int:
    """Nodes of a tree whose nodes at depth d (the root at 0) have widths[d] children each."""
    total, level = 0, 1
    for width in widths:
        level *= width
        total += level
    return total


def check_parents(parents: Sequence[int]) -> None:
    """Every node's parent is a lower-numbered node (the root is 0)."""
    for node, parent in enumerate(parents, start=1):
        if not 0 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}; a parent must be a lower-numbered node")


def children_of(parents: Sequence[int], num_nodes: int) -> list[list[int]]:
    """Children of each node 0..num_nodes-1, in index order."""
    check_parents(parents)
    children: list[list[int]] = [[] for _ in range(num_nodes)]
    for node, parent in enumerate(parents, start=1):
        children[parent].append(node)
    return children


def ancestors(parents: Sequence[int]) -> list[list[int]]:
    """For node i (1..N), the nodes from the root's child down to i itself."""
    check_parents(parents)
    paths: list[list[int]] = []
    for node, parent in enumerate(parents, start=1):
        paths.append(([] if parent == 0 else paths[parent - 1]) + [node])
    return paths


@dataclass(frozen=True)
class TreeVerifyOutputs:
    """The target's side of a tree round."""

    node_target_probs: torch.Tensor  # [N]: r_{i-1}(token) for node i, the i-th child of its parent
    next_token_ids: torch.Tensor  # [N + 1] int64: per node, a sample from r_m (all children rejected)


def tree_verify_outputs(
    target_probs: torch.Tensor,  # [N + 1, V]: the target at each node (row 0: the root)
    draft_probs: torch.Tensor | SparseRows,  # [N, V]: the distribution node i (1..N) was drawn from, row i - 1
    token_ids: torch.Tensor,  # [N] int64, on the host: each a plain index
    parents: Sequence[int],  # [N]
    generator: np.random.Generator,
) -> TreeVerifyOutputs:
    """Every child's residual-adjusted target probability, and every node's recovered (or,
    for a leaf, bonus) sample, drawn before and independently of the coordinator's uniforms."""
    num_nodes, draft_probs = target_probs.shape[0], rows_on(draft_probs, target_probs.device)
    children, ids = children_of(parents, num_nodes), token_ids.tolist()
    node_target_probs = torch.zeros(num_nodes - 1, dtype=target_probs.dtype, device=target_probs.device)  # [N]
    final_rows = []
    for node in range(num_nodes):
        residual = target_probs[node]  # [V]: r_0 = p
        for child in children[node]:
            node_target_probs[child - 1] = residual[ids[child - 1]]
            residual = residual_probs(residual[None], draft_probs[child - 1][None])[0]  # r_i
        final_rows.append(residual)
    next_token_ids = sample(torch.stack(final_rows), generator)  # [N + 1]
    return TreeVerifyOutputs(node_target_probs, next_token_ids)


@dataclass(frozen=True)
class TreeOutcome:
    path: list[int]  # accepted nodes, root's child first
    next_token_id: int  # recovered at the last accepted node, or the bonus at a leaf
    at_leaf: bool = False  # the path ends in a node without children: next_token_id is a bonus

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def is_bonus(self, num_draft: int = 0) -> bool:
        """As specdec.sampling.chain.RoundOutcome.is_bonus (the tree size does not matter)."""
        return self.at_leaf

    def committed(self, token_ids: Sequence[int]) -> list[int]:
        """Tokens this round adds: the accepted path's tokens, then the next token."""
        return [*(token_ids[node - 1] for node in self.path), self.next_token_id]


def decide_tree(
    node_target_probs: Sequence[float],  # [N]
    node_draft_probs: Sequence[float],  # [N]: q(token) under its parent's draft distribution, > 0
    uniforms: Sequence[float],  # [N], each in [0, 1): one per node, used if it is tried
    parents: Sequence[int],  # [N]
    next_token_ids: Sequence[int],  # [N + 1]
) -> TreeOutcome:
    """Walks the tree from the root: at each node the first child (in index order) that is
    accepted becomes the node; when none is, the node's next token ends the round."""
    children = children_of(parents, len(next_token_ids))
    node, path = 0, []
    while True:
        for child in children[node]:
            # u < r / q written without the division; strict, so r = 0 is never accepted.
            if uniforms[child - 1] * node_draft_probs[child - 1] < node_target_probs[child - 1]:
                path.append(child)
                node = child
                break
        else:
            return TreeOutcome(path, int(next_token_ids[node]), at_leaf=not children[node])
