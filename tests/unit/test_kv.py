"""plain_cache: a cache built around tensors without copying them, as DynamicCache would
build it, and forks that share their parent's entries without either seeing the other's
later writes."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.engine.kv import cache_prefix, plain_cache
from specdec.engine.tree_pass import keep_tree_path


def pairs(layers: int = 3, length: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(1, 2, length, 4, generator=generator), torch.randn(1, 2, length, 4, generator=generator))
        for _ in range(layers)
    ]


def test_a_plain_cache_holds_its_tensors_and_behaves_as_one_dynamic_cache_builds():
    given = pairs()
    plain, built = plain_cache(given), DynamicCache(given)
    assert [layer.keys.data_ptr() for layer in plain.layers] == [keys.data_ptr() for keys, _ in given]
    assert [vars(layer).keys() for layer in plain.layers] == [vars(layer).keys() for layer in built.layers]
    assert [type(layer) for layer in plain.layers] == [type(layer) for layer in built.layers]
    assert plain.get_seq_length() == built.get_seq_length() == 5
    new = torch.randn(1, 2, 1, 4)
    for index in range(3):
        assert all(torch.equal(a, b) for a, b in zip(plain.update(new, new, index), built.update(new, new, index)))
    assert plain.get_seq_length() == 6


@torch.inference_mode()
def test_a_fork_shares_its_parents_entries_and_neither_sees_the_others_writes():
    parent = plain_cache([(keys.clone(), values.clone()) for keys, values in pairs(length=6)])
    before = [(layer.keys[..., :4, :].clone(), layer.values[..., :4, :].clone()) for layer in parent.layers]
    fork = cache_prefix(parent, 4)
    assert fork.layers[0].keys.data_ptr() == parent.layers[0].keys.data_ptr()  # no copy
    # The parent moves on: a tree path kept in place past the fork's 4 entries (in the storage
    # they share), a crop, and new entries.
    keep_tree_path(parent, 4, [2])
    parent.crop(-1)
    for index in range(3):
        parent.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), index)
    # The fork runs on from its own four entries.
    for index in range(3):
        fork.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 7.0), index)
    for layer, (keys, values) in zip(fork.layers, before):
        assert torch.equal(layer.keys[..., :4, :], keys) and torch.equal(layer.values[..., :4, :], values)
        assert torch.equal(layer.keys[..., 4:, :], torch.full((1, 2, 1, 4), 7.0))
    assert parent.get_seq_length() == 7 and fork.get_seq_length() == 5
