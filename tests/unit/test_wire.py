"""The proposal-distribution codec: what the draft encodes decodes to the same float32 values
the draft sampled from, whichever wire form a row takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.state import MalformedReply, round_from
from specdec.errors import InvalidArgument
from specdec.rpc import wire
from specdec.sampling.probs import SparseRows, rows_on
from specdec.v1 import common_pb2, draft_pb2


def _rows(seed: int, vocab: int) -> torch.Tensor:
    """[K, V] distributions from one id to full support, so both sparse and dense forms appear."""
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 6, (), generator=generator))
    probs = torch.zeros(count, vocab)
    for row in range(count):
        support = torch.randperm(vocab, generator=generator)[
            : int(torch.randint(1, vocab + 1, (), generator=generator))
        ]
        probs[row, support] = torch.rand(len(support), generator=generator) + 0.01
    return probs / probs.sum(dim=-1, keepdim=True)


def _encode_row(row: torch.Tensor) -> common_pb2.ProposalDistribution:
    """The codec's rule for one [V] row, written out plainly as the reference."""
    support = torch.nonzero(row, as_tuple=True)[0]  # [nnz]
    if support.numel() <= row.numel() // 2:
        return common_pb2.ProposalDistribution(
            sparse=common_pb2.SparseProbs(
                token_ids_le=np.array(support.tolist(), "<i4").tobytes(),
                probs_le=np.array(row[support].tolist(), "<f4").tobytes(),
            )
        )
    return common_pb2.ProposalDistribution(dense=wire.encode_dense(row))


def _sparse_forms(ids: list[int], probs: list[float]) -> list[common_pb2.ProposalDistribution]:
    """One sparse row in both wire forms: repeated fields (as older drafts send) and packed."""
    return [
        common_pb2.ProposalDistribution(sparse=common_pb2.SparseProbs(token_ids=ids, probs=probs)),
        common_pb2.ProposalDistribution(sparse=wire.packed_sparse(np.array(ids), np.array(probs))),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_encoding_rows_together_equals_each_row_alone_and_decodes_exactly(seed):
    probs = _rows(seed, vocab=300)
    together = wire.encode_distributions(probs, len(probs), deterministic=False)
    assert together == [_encode_row(row) for row in probs]
    token_ids = [0] * len(probs)
    assert torch.equal(rows_on(wire.decode_distributions(together, token_ids, 300), "cpu"), probs)


def test_both_forms_appear():
    all_rows = [_rows(seed, 300) for seed in range(20)]
    forms = {d.WhichOneof("kind") for rows in all_rows for d in wire.encode_distributions(rows, len(rows), False)}
    assert forms == {"sparse", "dense"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_a_value_that_is_not_a_probability_is_refused_in_either_form(bad):
    dense = common_pb2.ProposalDistribution(
        dense=common_pb2.DenseProbs(float32_le=np.array([0.5, bad, 0.0], "<f4").tobytes())
    )
    for distribution in (*_sparse_forms([1, 2], [0.5, bad]), dense):
        with pytest.raises(InvalidArgument, match="finite, non-negative"):
            wire.decode_distributions([distribution], [1], 3)


@pytest.mark.parametrize("scale", [0.5, 0.99, 1.01, 2.0])
def test_a_row_whose_mass_is_not_one_is_refused_in_either_form(scale):
    """A row scaled by c accepts each draft with min(1, p/(cq)) and leaves the wrong residual."""
    scaled = np.array([0.0, 0.25, 0.75], "<f4") * np.float32(scale)
    dense = common_pb2.ProposalDistribution(dense=common_pb2.DenseProbs(float32_le=scaled.tobytes()))
    for distribution in (*_sparse_forms([1, 2], [0.25 * scale, 0.75 * scale]), dense):
        with pytest.raises(InvalidArgument, match="sums to .*, not 1"):
            wire.decode_distributions([distribution], [1], 3)


def test_a_softmax_over_qwens_width_passes_in_float32():
    wide = torch.softmax(torch.randn(151_936, generator=torch.Generator().manual_seed(0)) * 4, dim=0)
    rows = wire.encode_distributions(wide[None], 1, deterministic=False)
    assert torch.equal(rows_on(wire.decode_distributions(rows, [0], 151_936), "cpu")[0], wide)


def test_mass_past_the_targets_width_counts():
    """A draft wider than the target sends its whole row; mass past the width is dropped only
    after the row was found to be a distribution."""
    sparse = common_pb2.ProposalDistribution(sparse=common_pb2.SparseProbs(token_ids=[1, 5], probs=[0.5, 0.5]))
    assert rows_on(wire.decode_distributions([sparse], [1], 3), "cpu").tolist() == [[0.0, 0.5, 0.0]]
    short = common_pb2.ProposalDistribution(sparse=common_pb2.SparseProbs(token_ids=[1], probs=[0.5]))
    with pytest.raises(InvalidArgument, match="sums to 0.5, not 1"):
        wire.decode_distributions([short], [1], 3)


@pytest.mark.parametrize("ids", [[1, 1], [-1, 1]])
def test_a_sparse_row_naming_an_id_twice_or_a_negative_one_is_refused(ids):
    """A repeated id would give the target's residual its last value and the coordinator's
    acceptance test (token_probability) its first: the output would not be the target's."""
    for sparse in _sparse_forms(ids, [0.2, 0.8]):
        with pytest.raises(InvalidArgument, match="negative token id|twice"):
            wire.decode_distributions([sparse], [1], 3)


def test_a_sparse_row_naming_an_id_twice_with_one_value_is_refused():
    """Its mass counts the id twice (here 1) where the row it decodes to holds 0.75."""
    for sparse in _sparse_forms([1, 1, 2], [0.25, 0.25, 0.5]):
        with pytest.raises(InvalidArgument, match="names a token id twice"):
            wire.decode_distributions([sparse], [1], 3)


def test_a_sparse_row_reads_the_same_in_either_form():
    """A draft older than the packed form keeps working: the same row, the same decoded
    values, the same probability for the coordinator's acceptance test."""
    repeated, packed = _sparse_forms([9, 2, 5], [0.5, 0.125, 0.375])
    want = torch.tensor([[0, 0, 0.125, 0, 0, 0.375, 0, 0, 0, 0.5]])
    for row in (repeated, packed):
        assert torch.equal(rows_on(wire.decode_distributions([row], [5], 10), "cpu"), want)
        assert [wire.token_probability(row, token) for token in (5, 9, 3)] == [0.375, 0.5, 0.0]


@pytest.mark.parametrize(
    "sparse, said",
    [
        (common_pb2.SparseProbs(token_ids_le=b"\x01\x00\x00", probs_le=b"\x00\x00\x80\x3f"), "multiple of 4"),
        (common_pb2.SparseProbs(token_ids_le=bytes(8), probs_le=bytes(4)), "2 ids but 1 probs"),
        (
            common_pb2.SparseProbs(token_ids=[1], probs=[1.0], token_ids_le=bytes(4), probs_le=bytes(4)),
            "both packed and repeated",
        ),
    ],
)
def test_a_malformed_packed_row_is_refused_by_the_target_and_the_coordinator(sparse, said):
    """The target refuses the verify; the coordinator fails the request as a malformed reply
    (counted), never reading a row other than the one the draft sent."""
    row = common_pb2.ProposalDistribution(sparse=sparse)
    with pytest.raises(InvalidArgument, match=said):
        wire.decode_distributions([row], [1], 3)
    reply = draft_pb2.ProposeResponse(token_ids=[1], distributions=[row])
    with pytest.raises(MalformedReply, match=f"draft service at d:1 sent a malformed distribution: .*{said}"):
        round_from(reply, 1, "d:1", 3)


def test_features_with_rows_but_no_width_are_refused():
    with pytest.raises(InvalidArgument, match="rows come with a width"):
        wire.features_from_pb(common_pb2.Features(start=0, rows=1, width=0, dtype="float32", data=b""))


@pytest.mark.parametrize("seed", range(20))
def test_a_top_k_row_knows_its_support_and_encodes_as_the_scan_does(seed):
    """top_k_parts keeps exactly what truncate_top_k keeps (bit for bit), names exactly the
    non-zero entries, and the encoder given those writes what its scan writes. Rows with
    fewer than k non-zero entries (after top-p, say) and ties at the k-th value included."""
    from specdec.sampling.probs import SamplingParams, logits_to_probs, support_of, top_k_parts, truncate_top_k

    def top_k_with_support(row, top_k):
        kept, parts = top_k_parts(row, top_k)
        return kept, None if parts is None else support_of(parts.tolist())

    generator = torch.Generator().manual_seed(seed)
    vocab, top_k = 500, 16
    logits = torch.randn(4, vocab, generator=generator) * 3
    rows = [
        logits_to_probs(logits[0], SamplingParams(temperature=0.7)),
        logits_to_probs(logits[1], SamplingParams(temperature=1.0, top_p=0.3)),  # few entries left
        logits_to_probs(logits[2], SamplingParams(temperature=1.0, top_k=5)),
        torch.full((vocab,), 1.0 / vocab),  # every entry ties the k-th
    ]
    supports = []
    for row in rows:
        kept, support = top_k_with_support(row, top_k)
        assert torch.equal(kept, truncate_top_k(row, top_k))
        if support is not None:
            assert torch.equal(support.ids, torch.nonzero(kept, as_tuple=True)[0])
            assert torch.equal(support.values, kept[support.ids])
        supports.append(support)
    assert supports[-1] is None and all(s is not None for s in supports[:-1])
    probs = torch.stack([top_k_with_support(row, top_k)[0] for row in rows[:-1]])
    assert wire.encode_distributions(probs, 3, False, supports[:-1]) == wire.encode_distributions(probs, 3, False)
    # A row without a known support falls back to the scan.
    everything = torch.stack([top_k_with_support(row, top_k)[0] for row in rows])
    assert wire.encode_distributions(everything, 4, False, supports) == wire.encode_distributions(everything, 4, False)


def test_info_says_which_machine_and_cpus_compute():
    """ModelInfo.host_id and cpus reach the wire (the K chooser's shared-host costing reads them)."""
    from specdec.engine.calls import ModelDescription, these_cpus, this_host

    description = ModelDescription("m", 8, "f", (0,), 16, "float32", "cpu", 0, 4)
    info = wire.description_to_pb(description)
    assert info.host_id == this_host() != ""
    assert tuple(info.cpus) == these_cpus() and info.cpus


def test_rows_without_a_dense_one_come_as_their_entries():
    """What crosses to the target's device is the rows' entries (kilobytes), not [K, V]."""
    one_hot = common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())
    sparse = common_pb2.ProposalDistribution(
        sparse=common_pb2.SparseProbs(token_ids=[4, 1, 9], probs=[0.5, 0.25, 0.25])
    )
    dense = common_pb2.ProposalDistribution(dense=wire.encode_dense(torch.tensor([0.0, 0.5, 0.5])))
    rows = wire.decode_distributions([one_hot, sparse, one_hot], [2, 7, 9], 8)  # ids 9 and past: beyond the width
    assert isinstance(rows, SparseRows) and rows.values.numel() == 3
    want = torch.zeros(3, 8)
    want[0, 2], want[1, 4], want[1, 1] = 1.0, 0.5, 0.25
    assert torch.equal(rows_on(rows, "cpu"), want)
    mixed = wire.decode_distributions([sparse, dense], [7, 1], 8)
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed[1], torch.tensor([0.0, 0.5, 0.5, 0, 0, 0, 0, 0]))
    assert torch.equal(mixed[0], want[1])
