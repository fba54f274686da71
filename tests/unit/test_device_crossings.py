"""A verify's outputs cross from the model's device to the host once per pass (issue 67): on an
accelerator every crossing is a wait for the queued work. On a CPU nothing waits, so the
passes' logits are tagged here with a tensor subclass that every op propagates, and each way a
tensor reaches the host (`.item()`, `.tolist()`, `.cpu()`, `float()`, ...) is counted."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from draft_service.runner import DraftRunner, ProposeCall
from specdec.engine.batched_pass import DecodeBatch
from specdec.engine.features import FeatureTap
from specdec.engine.modeling import load_causal_lm
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams, SparseRows
from specdec.sampling.relaxed import RelaxedAcceptance
from target_service.runner import TargetRunner, VerifyCall

CROSSINGS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}


class OnDevice(torch.Tensor):
    """A tensor standing for one on an accelerator; what reaches the host is a plain tensor."""

    crossed: collections.Counter[str] = collections.Counter()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(value) == "cpu" for value in (*args[1:], *kwargs.values()))
        out = super().__torch_function__(func, types, args, kwargs)
        if name in CROSSINGS or to_host:
            caller = traceback.extract_stack(limit=3)[0]
            cls.crossed[f"{name} at {caller.name}:{caller.lineno}"] += 1
            if isinstance(out, torch.Tensor):
                out = out.as_subclass(torch.Tensor)
        return out


@pytest.fixture
def on_device(monkeypatch) -> collections.Counter[str]:
    """The runner's passes give OnDevice logits; returns the counter of crossings."""

    def tagged(method):
        def run(*args, **kwargs):
            out = method(*args, **kwargs)
            if isinstance(out, list):
                return [item.as_subclass(OnDevice) if isinstance(item, torch.Tensor) else item for item in out]
            if isinstance(out, dict):
                return {key: item.as_subclass(OnDevice) for key, item in out.items()}
            return out.as_subclass(OnDevice)

        return run

    for runner in (TargetRunner, DraftRunner):
        for name in ("forward", "forward_tree", "forward_batch"):
            monkeypatch.setattr(runner, name, tagged(getattr(runner, name)))
    monkeypatch.setattr(FeatureTap, "rows", tagged(FeatureTap.rows))  # read off the pass by hooks
    monkeypatch.setattr(DecodeBatch, "step", tagged(DecodeBatch.step))  # a batch of drafts' later steps
    OnDevice.crossed.clear()
    return OnDevice.crossed


PARAMS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_k=50)}


def rows(runner: TargetRunner, k: int) -> torch.Tensor:
    vocab = runner.loaded.vocab_size
    return torch.full((k, vocab), 1.0 / vocab)


@pytest.mark.parametrize("decoding", PARAMS)
def test_a_chain_verify_crosses_once(target_runner, on_device, decoding):
    params = PARAMS[decoding]
    session = f"cross-{decoding}"
    target_runner.verify_one(
        VerifyCall(session, 0, list(range(5, 25)), [30, 31, 32], rows(target_runner, 3), params, 1)
    )
    for drafts in ([41, 42, 43], []):  # a round, then a target-only step
        on_device.clear()
        done = target_runner.verify_one(
            VerifyCall(session, 21, [40], drafts, rows(target_runner, len(drafts)), params, 2)
        )
        assert len(done.recovered_token_ids) == len(drafts)
        assert sum(on_device.values()) == 1, dict(on_device)
    target_runner.end_session(session)


@pytest.mark.parametrize("decoding", PARAMS)
def test_a_tree_verify_crosses_once(target_runner, on_device, decoding):
    params, session = PARAMS[decoding], f"cross-tree-{decoding}"
    target_runner.verify_one(VerifyCall(session, 0, list(range(5, 25)), [], rows(target_runner, 0), params, 1))
    on_device.clear()
    tree = VerifyCall(session, 20, [40], [41, 42, 43], entries(rows(target_runner, 3)), params, 2, parents=(0, 0, 1))
    assert len(target_runner.verify_one(tree).recovered_token_ids) == 4
    assert sum(on_device.values()) == 1, dict(on_device)
    target_runner.end_session(session)


@pytest.mark.parametrize("decoding", PARAMS)
def test_what_a_call_asks_for_beside_its_draws_crosses_with_them(target_runner, on_device, decoding):
    """The target's rows, log-probabilities, relaxed verdicts and features come in the same
    transfer as the draws: a chain asking for all of them, and a tree for what a tree may ask."""
    params, session = PARAMS[decoding], f"cross-extras-{decoding}"
    asks = dict(return_distributions=True, top_logprobs=3)
    target_runner.verify_one(VerifyCall(session, 0, list(range(5, 25)), [], rows(target_runner, 0), params, 1))
    on_device.clear()
    chain = VerifyCall(
        session, 20, [40], [41, 42, 43], rows(target_runner, 3), params, 2,
        relaxed=RelaxedAcceptance(), feature_layers=(0, 1), **asks,
    )  # fmt: skip
    done = target_runner.verify_one(chain)
    assert done.target_probs.shape[0] == 4 and len(done.relaxed_accepts) == 3 and len(done.logprobs.rows) == 4
    assert done.features.shape[0] == done.processed_tokens and type(done.features) is torch.Tensor
    assert sum(on_device.values()) == 1, dict(on_device)
    on_device.clear()
    tree = VerifyCall(session, 23, [44], [45, 46, 47], rows(target_runner, 3), params, 3, parents=(0, 0, 1), **asks)
    done = target_runner.verify_one(tree)
    assert done.target_probs.shape[0] == 4 and len(done.logprobs.top_ids) == 4
    assert sum(on_device.values()) == 1, dict(on_device)
    target_runner.end_session(session)


@pytest.mark.parametrize("decoding", PARAMS)
def test_a_batched_verify_crosses_once_for_all_its_calls(target_runner, on_device, decoding):
    params, sessions = PARAMS[decoding], [f"cross-batch-{decoding}-{i}" for i in range(3)]
    for i, session in enumerate(sessions):
        target_runner.verify_one(VerifyCall(session, 0, list(range(5 + i, 25)), [], rows(target_runner, 0), params, i))
    on_device.clear()
    done = target_runner.verify_batch(
        [
            VerifyCall(session, 20 - i, [40], [41, 42], entries(rows(target_runner, 2)), params, i)
            for i, session in enumerate(sessions)
        ]
    )
    assert all(result.batch_size == 3 for result in done), done
    assert sum(on_device.values()) == 1, dict(on_device)
    for session in sessions:
        target_runner.end_session(session)


@pytest.fixture(scope="module")
def draft_runner(tiny_pair) -> DraftRunner:
    """The service's own settings: sampled rows cut to their top PROPOSAL_TOP_K, confidence stop off."""
    return DraftRunner(load_causal_lm(str(tiny_pair.draft), "float32", "cpu"), 8, 60, 8, min_confidence=0.0)


@pytest.mark.parametrize("decoding", PARAMS)
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_proposal_crosses_once_a_step_rows_and_all(draft_runner, on_device, decoding, batched):
    """A draft's step crosses once (its token, which the next step's pass needs), and a sampled
    proposal's rows reach the wire in those crossings: their entries come with each step's
    token, so the [K, V] rows stay on the device."""
    params, sessions = PARAMS[decoding], [f"draft-{decoding}-{batched}-{i}" for i in range(2 if batched else 1)]
    calls = [ProposeCall(session, 0, list(range(5 + i, 25)), 4, params, seed=i) for i, session in enumerate(sessions)]
    on_device.clear()
    done = draft_runner.propose_batch(calls) if batched else [draft_runner.propose_one(calls[0])]
    for proposal in done:
        assert len(proposal.token_ids) == 4
        sent = wire.encode_distributions(proposal.probs, 4, proposal.deterministic, proposal.supports)
        assert all(row.WhichOneof("kind") == ("one_hot" if decoding == "greedy" else "sparse") for row in sent)
    assert sum(on_device.values()) == 4 * (1 if batched else len(calls)), dict(on_device)
    for session in sessions:
        draft_runner.end_session(session)


@pytest.mark.parametrize("decoding", PARAMS)
def test_a_draft_tree_crosses_once_a_level_and_a_vocab_limit_not_at_all(draft_runner, on_device, decoding):
    """A token tree's level (every frontier node's children, drawn or taken) crosses once; a
    call whose vocab_limit masks rows decides which on the host."""
    params, limit = PARAMS[decoding], draft_runner.loaded.vocab_size - 40
    tree = ProposeCall(f"tree-{decoding}", 0, list(range(5, 25)), 0, params, seed=1, tree_widths=(3, 2, 1))
    done = draft_runner.propose_one(tree)
    assert len(done.parents) == 3 + 6 + 6
    assert sum(on_device.values()) == 3, dict(on_device)
    on_device.clear()
    limited = ProposeCall(f"limited-{decoding}", 0, list(range(5, 25)), 4, params, seed=2, vocab_limit=limit)
    assert all(token < limit for token in draft_runner.propose_one(limited).token_ids)
    assert sum(on_device.values()) == 4, dict(on_device)
    for session in (tree.session_id, limited.session_id):
        draft_runner.end_session(session)


def test_the_count_sees_a_crossing(on_device):
    """The mutant: an extra `.item()` on the tagged logits is counted."""
    logits = torch.zeros(2, 3).as_subclass(OnDevice)
    float(logits.sum()), logits.argmax(-1).tolist()
    assert sum(on_device.values()) == 2, dict(on_device)


def entries(dense: torch.Tensor) -> SparseRows:
    flat = dense.reshape(-1)
    ids = torch.nonzero(flat, as_tuple=True)[0]
    return SparseRows(ids, flat[ids], tuple(dense.shape))


@pytest.mark.parametrize("shape", ["chain", "tree", "batch"])
def test_rows_sent_as_their_entries_verify_as_the_dense_rows(target_runner, shape):
    """The draft rows a sampled verify builds on its device from their entries (SparseRows) give
    bitwise the outputs of the same rows built on the host. The rows are the target's own,
    cut to their 16 likeliest ids, so the residuals are what the rows leave out: a row built
    wrong moves them, and with them the recovered tokens."""
    vocab, params, prompt, drafts = target_runner.loaded.vocab_size, PARAMS["sampled"], list(range(5, 25)), [7, 8, 9]
    probe = VerifyCall("rows-probe", 0, prompt, drafts, torch.full((3, vocab), 1.0 / vocab), params, 0, True)
    target = target_runner.verify_one(probe).target_probs[:3]  # [3, V]
    target_runner.end_session("rows-probe")
    dense = torch.where(target >= target.topk(16, -1).values[:, -1:], target, 0.0)
    dense = dense / dense.sum(-1, keepdim=True)  # [3, V]
    parents, calls = (0, 1, 2) if shape == "tree" else (), 3 if shape == "batch" else 1
    outputs = []
    for rows in (dense, entries(dense)):
        done = []
        for seed in range(0, 24, calls):
            batch = [
                VerifyCall(f"rows-{i}", 0, prompt, drafts, rows, params, seed + i, parents=parents)
                for i in range(calls)
            ]
            done += target_runner.verify_batch(batch)
            for call in batch:
                target_runner.end_session(call.session_id)
        outputs.append([(d.draft_token_target_probs, d.recovered_token_ids, d.bonus_token_id) for d in done])
    assert outputs[0] == outputs[1]
