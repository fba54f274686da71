"""Tree acceptance (specdec.sampling.tree_sampling) keeps the target's distribution, with power.

Generations are simulated round by round with the pure functions alone: a draft and a target
that are lookup tables over 3 tokens (tests/table_services.TableModel), a tree of i.i.d.
children drawn from the draft at each node, the target's side (`tree_verify_outputs`) and the
coordinator's walk (`decide_tree`), each from its own random stream. 40,000 generations of 3
tokens (27 outcomes) detect any bias of total variation 0.02 with probability 0.96 at
p < 1e-4 (see tests/heavy/test_mode_distributions.py), and two inexact variants fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.sampling import tree_sampling
from specdec.sampling.tree_sampling import children_of, decide_tree, tree_verify_outputs
from tests.stats import MUTANT_P_VALUE, P_VALUE_FLOOR, chi_square_p_value
from tests.table_services import TableModel

VOCAB = 3
PROMPT = (1, 0, 1)
LENGTH = 3
SAMPLES = 40_000
SHAPE = (2, 2)  # children per node at depth 1 and 2: 2 + 4 = 6 draft nodes
TARGET = TableModel(VOCAB, salt=1)
DRAFT = TableModel(VOCAB, salt=2, base=TARGET, noise=0.8)


def one_hot(row: np.ndarray) -> np.ndarray:
    out = np.zeros_like(row)
    out[int(np.argmax(row))] = 1.0
    return out


def streams(seed: int) -> tuple[np.random.Generator, ...]:
    """The draft's draws, the target's draws and the coordinator's uniforms: independent."""
    return tuple(np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(3))


def generate(
    rngs: tuple[np.random.Generator, ...],
    distinct_children: bool = False,
    greedy: bool = False,
    paths: list | None = None,
    top_b_one_hot: bool = False,
) -> tuple[int, ...]:
    """LENGTH tokens after PROMPT by tree rounds, drawing from `rngs` (see `streams`).
    `distinct_children`: each node's children are drawn without replacement (top-b distinct
    tokens when `greedy`). `top_b_one_hot`: a sampled target with the draft's top-b tokens as
    children, each sent one-hot at itself. `paths` collects each round's accepted path."""
    draft_rng, target_rng, coins = rngs
    context, out = PROMPT, []
    while len(out) < LENGTH:
        contexts, token_ids, parents, frontier = [context], [], [], [0]
        for width in SHAPE:
            grown = []
            for node in frontier:
                q = DRAFT.probs(contexts[node])
                if greedy or top_b_one_hot:
                    drawn = np.argsort(-q, kind="stable")[:width].tolist()
                elif distinct_children:
                    drawn = draft_rng.choice(VOCAB, size=width, replace=False, p=q).tolist()
                else:
                    drawn = draft_rng.choice(VOCAB, size=width, p=q).tolist()
                for token in drawn:
                    token_ids.append(token)
                    parents.append(node)
                    contexts.append(contexts[node] + (token,))
                    grown.append(len(token_ids))
            frontier = grown
        target_rows = np.stack([TARGET.probs(c) for c in contexts])  # [N + 1, V]
        if greedy:
            target_rows = np.stack([one_hot(row) for row in target_rows])
        # [N, V]: the distribution each node was drawn from (its parent's, or one-hot at itself)
        draft_rows = np.stack([DRAFT.probs(contexts[parent]) for parent in parents])
        if top_b_one_hot or greedy:
            draft_rows = np.eye(VOCAB)[token_ids]
        verified = tree_verify_outputs(
            torch.from_numpy(target_rows), torch.from_numpy(draft_rows), torch.tensor(token_ids), parents, target_rng
        )
        outcome = decide_tree(
            verified.node_target_probs.tolist(),
            [float(draft_rows[node, token]) for node, token in enumerate(token_ids)],
            coins.random(len(token_ids)).tolist(),
            parents,
            verified.next_token_ids.tolist(),
        )
        committed = outcome.committed(token_ids)
        if paths is not None:
            paths.append(outcome.path)
        out += committed
        context += tuple(committed)
    return tuple(out[:LENGTH])


def test_tree_rounds_have_the_target_distribution():
    rngs, paths = streams(0), []
    samples = [generate(rngs, paths=paths) for _ in range(SAMPLES)]
    # Nodes 1, 2 are the root's children; 3, 4 node 1's; 5, 6 node 2's: every kind of step ran.
    assert sum(len(path) == 2 for path in paths) > SAMPLES // 10, "few rounds accepted a whole branch"
    assert sum(bool({2, 4, 6} & set(path)) for path in paths) > SAMPLES // 10, "second siblings were rarely accepted"
    assert sum(not path for path in paths) > SAMPLES // 20, "few rounds rejected every child of the root"
    p_value = chi_square_p_value(samples, TARGET.continuations(PROMPT, LENGTH))
    assert p_value > P_VALUE_FLOOR, f"χ² p-value {p_value:.2e}: tree rounds are not the target's distribution"


def test_power_a_residual_not_updated_between_siblings_fails(monkeypatch):
    """Every sibling tried against p itself, and the recovered token drawn from p."""
    monkeypatch.setattr(tree_sampling, "residual_probs", lambda target_probs, draft_probs: target_probs)
    rngs = streams(1)
    samples = [generate(rngs) for _ in range(SAMPLES // 4)]
    assert chi_square_p_value(samples, TARGET.continuations(PROMPT, LENGTH)) < MUTANT_P_VALUE


def test_power_children_drawn_without_replacement_fail():
    """The rule's premise is i.i.d. children; distinct ones (sampling without replacement)
    are not, and the output drifts from the target's distribution."""
    rngs = streams(2)
    samples = [generate(rngs, distinct_children=True) for _ in range(SAMPLES // 4)]
    assert chi_square_p_value(samples, TARGET.continuations(PROMPT, LENGTH)) < MUTANT_P_VALUE


def test_top_b_children_sent_one_hot_have_the_target_distribution():
    """Deterministic distinct candidates (the draft's top-b) are independent draws from point
    masses: sent one-hot, the rule stays exact for a sampled target."""
    rngs, paths = streams(4), []
    samples = [generate(rngs, top_b_one_hot=True, paths=paths) for _ in range(SAMPLES)]
    assert sum(bool({2, 4, 6} & set(path)) for path in paths) > SAMPLES // 10, "second candidates were rarely accepted"
    p_value = chi_square_p_value(samples, TARGET.continuations(PROMPT, LENGTH))
    assert p_value > P_VALUE_FLOOR, f"χ² p-value {p_value:.2e}: one-hot top-b trees are not the target's distribution"


def test_greedy_tree_with_top_b_children_gives_the_targets_argmax_chain():
    """A one-hot target accepts exactly the child equal to its argmax, so distinct top-b
    children are fine for greedy: the output is the target's greedy continuation."""
    expected, context = [], PROMPT
    for _ in range(LENGTH):
        expected.append(int(np.argmax(TARGET.probs(context))))
        context += (expected[-1],)
    rngs = streams(3)
    assert all(generate(rngs, greedy=True) == tuple(expected) for _ in range(20))


def test_decide_tree_walks_the_first_accepted_child_down():
    # root -> 1, 2; 1 -> 3; 2 -> 4
    parents = [0, 0, 1, 2]
    next_token_ids = [10, 11, 12, 13, 14]
    # Node 1 rejected (u·q ≥ r), node 2 accepted, node 4 accepted: ends at leaf 4 with its bonus.
    outcome = decide_tree([0.1, 0.5, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.9, 0.1, 0.1, 0.1], parents, next_token_ids)
    assert outcome.path == [2, 4] and outcome.next_token_id == 14 and outcome.is_bonus()
    assert outcome.committed([7, 8, 9, 6]) == [8, 6, 14]
    # Every root child rejected: the root's recovered token.
    outcome = decide_tree([0.0, 0.0, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0], parents, next_token_ids)
    assert outcome.path == [] and outcome.next_token_id == 10, "a child of target probability 0 is never accepted"
    assert not outcome.is_bonus() and outcome.num_accepted == 0


def test_tree_verify_outputs_updates_the_residual_per_sibling():
    """Two children of the root: the second is tried against norm(max(0, p − q))."""
    target = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[0.6, 0.2, 0.2], [0.6, 0.2, 0.2]])  # both children drawn from the root's q
    verified = tree_verify_outputs(target, draft, torch.tensor([0, 1]), [0, 0], np.random.default_rng(0))
    # r_0 = p: p(0) = 0.5; r_1 = norm(max(0, p − q)) = [0, 1, 0]: r_1(1) = 1.
    assert torch.allclose(verified.node_target_probs, torch.tensor([0.5, 1.0]))
    # After both rejected, r_2 = norm(max(0, r_1 − q)) = [0, 1, 0]: the recovered token is 1.
    assert int(verified.next_token_ids[0]) == 1


def test_tree_size_counts_every_level():
    assert tree_sampling.tree_size([2, 2]) == 6 and tree_sampling.tree_size([3, 1, 1]) == 9
    assert tree_sampling.tree_size([]) == 0


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="lower-numbered"):
        children_of([0, 2], 3)
