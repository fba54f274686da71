"""The draft and target RPCs as the coordinator (or any other caller) sees them over gRPC."""

from __future__ import annotations

import asyncio
import re
import struct

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch

from specdec.sampling.probs import SamplingParams, logits_to_probs
from specdec.tools import client as client_cli
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.stack import inprocess_stack

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    # Dense full distributions: the draft's top-k is a runner argument, not a flag.
    async with inprocess_stack(tiny_pair, draft_runner_overrides={"proposal_top_k": 0}) as running:
        draft_channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.draft.port}")
        target_channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.target.port}")
        running.draft_stub = draft_pb2_grpc.DraftStub(draft_channel)
        running.target_stub = target_pb2_grpc.TargetStub(target_channel)
        yield running
        await draft_channel.close()
        await target_channel.close()


async def test_info_describes_model(stack, tiny_pair):
    draft_info = await stack.draft_stub.Info(common_pb2.InfoRequest())
    target_info = await stack.target_stub.Info(common_pb2.InfoRequest())
    assert target_info.model_id == str(tiny_pair.target) and draft_info.model_id == str(tiny_pair.draft)
    assert target_info.vocab_size == tiny_pair.vocab_size
    assert list(target_info.eos_token_ids) == [tiny_pair.eos_token_id]
    assert target_info.max_context == 256
    assert target_info.tokenizer_fingerprint == draft_info.tokenizer_fingerprint
    assert target_info.dtype == "float32" and target_info.device == "cpu"


async def test_unknown_session_is_not_found(stack):
    for call, request in (
        (
            stack.draft_stub.Propose,
            draft_pb2.ProposeRequest(session_id="ghost", keep_tokens=3, new_tokens=[1], num_tokens=2, sampling=GREEDY),
        ),
        (
            stack.target_stub.Verify,
            target_pb2.VerifyRequest(session_id="ghost", keep_tokens=3, new_tokens=[1], sampling=GREEDY),
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(request)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "keep_tokens=0" in error.value.details()


@pytest.mark.parametrize(
    "request_fields, message",
    [
        (
            dict(
                draft_token_ids=[5, 6],
                draft_distributions=[common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())],
            ),
            "2 draft tokens but 1 distributions",
        ),
        (dict(draft_token_ids=[5], draft_distributions=[common_pb2.ProposalDistribution()]), "distribution 0 is empty"),
        (dict(new_tokens=[]), "new_tokens is empty"),
        (dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0)), r"top_p must be in \(0, 1\]"),
        (
            dict(
                draft_token_ids=[5],
                draft_distributions=[common_pb2.ProposalDistribution(dense=common_pb2.DenseProbs(float32_le=b"abc"))],
            ),
            "multiple of 4",
        ),
        # Sampled rounds read the distributions: every value carried must be a probability.
        (
            dict(
                draft_token_ids=[5],
                sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0),
                draft_distributions=[
                    common_pb2.ProposalDistribution(
                        sparse=common_pb2.SparseProbs(token_ids=[5, 6], probs=[0.5, float("nan")])
                    )
                ],
            ),
            "finite, non-negative",
        ),
        (
            dict(
                draft_token_ids=[5],
                sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0),
                draft_distributions=[
                    common_pb2.ProposalDistribution(
                        dense=common_pb2.DenseProbs(float32_le=struct.pack("<3f", 0.5, -0.25, 0.75))
                    )
                ],
            ),
            "finite, non-negative",
        ),
        (
            dict(
                draft_token_ids=[5],
                draft_distributions=[common_pb2.ProposalDistribution(one_hot=common_pb2.OneHot())],
                step_seeds=[1],
            ),
            "step_seeds need a target-only call",
        ),
        (dict(step_seeds=[1], return_distributions=True), "step_seeds need a target-only call"),
        (dict(step_seeds=list(range(65))), "at most 64 step_seeds"),
    ],
)
async def test_malformed_verify_is_invalid_argument(stack, request_fields, message):
    fields = dict(session_id="bad-verify", keep_tokens=0, new_tokens=[1, 2, 3], sampling=GREEDY)
    fields.update(request_fields)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stack.target_stub.Verify(target_pb2.VerifyRequest(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, error.value.details()), error.value.details()


async def test_a_target_only_verify_steps_on_with_each_seed_and_stops_after_a_stop_token(stack):
    """VerifyRequest.step_seeds: the tokens N + 1 single calls with those seeds would give,
    the session holding all but the last; a stop token ends the steps."""
    prompt, seeds = [10, 20, 30, 40], [11, 12, 13]
    stepped = await stack.target_stub.Verify(
        target_pb2.VerifyRequest(
            session_id="steps", new_tokens=prompt, sampling=SAMPLED, seed=10, step_seeds=seeds, stop_token_ids=[-1]
        )
    )
    tokens = [stepped.bonus_token_id, *stepped.step_token_ids]
    assert len(tokens) == 4 and stepped.sequence_length == len(prompt) + 3
    assert stepped.processed_tokens == len(prompt) + 3
    single, sent = [], prompt
    for seed in (10, *seeds):
        reply = await stack.target_stub.Verify(
            target_pb2.VerifyRequest(
                session_id="single", keep_tokens=len(prompt) + len(single) - len(sent), new_tokens=sent,
                sampling=SAMPLED, seed=seed,
            )
        )  # fmt: skip
        single.append(reply.bonus_token_id)
        sent = [reply.bonus_token_id]
    assert single == tokens
    stopped = await stack.target_stub.Verify(
        target_pb2.VerifyRequest(
            session_id="stops", new_tokens=prompt, sampling=SAMPLED, seed=10, step_seeds=seeds,
            stop_token_ids=[tokens[1]],
        )
    )  # fmt: skip
    assert [stopped.bonus_token_id, *stopped.step_token_ids] == tokens[: tokens.index(tokens[1]) + 1]


async def test_propose_then_verify_with_full_distributions(stack):
    prompt = [10, 20, 30, 40]
    proposal = await stack.draft_stub.Propose(
        draft_pb2.ProposeRequest(
            session_id="rt", keep_tokens=0, new_tokens=prompt, num_tokens=3, sampling=SAMPLED, seed=5
        )
    )
    assert len(proposal.token_ids) == 3 and proposal.processed_tokens == len(prompt) + 2
    assert all(d.WhichOneof("kind") == "dense" for d in proposal.distributions)
    verification = await stack.target_stub.Verify(
        target_pb2.VerifyRequest(
            session_id="rt",
            keep_tokens=0,
            new_tokens=prompt,
            draft_token_ids=proposal.token_ids,
            draft_distributions=proposal.distributions,
            sampling=SAMPLED,
            seed=9,
            return_distributions=True,
        )
    )
    assert len(verification.target_distributions) == 4
    target_probs = torch.tensor(
        np.stack([np.frombuffer(d.float32_le, dtype="<f4") for d in verification.target_distributions])
    )
    with torch.inference_mode():
        logits = stack.target_runner.model(torch.tensor([prompt + list(proposal.token_ids)])).logits[0, -4:]
    torch.testing.assert_close(target_probs, logits_to_probs(logits, SamplingParams(temperature=1.0)))
    for i, token in enumerate(proposal.token_ids):
        assert verification.draft_token_target_probs[i] == pytest.approx(float(target_probs[i, token]))
    for stub in (stack.draft_stub, stack.target_stub):
        assert (await stub.EndSession(common_pb2.EndSessionRequest(session_id="rt"))).existed
        assert not (await stub.EndSession(common_pb2.EndSessionRequest(session_id="rt"))).existed


async def test_client_cli_prints_completion(stack, capsys):
    address = f"127.0.0.1:{stack.coordinator.port}"
    code = await asyncio.to_thread(
        client_cli.main, ["def add(a, b):", "--address", address, "--max-new-tokens", "8", "--k", "3"]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "[finish: " in captured.err and "8 tokens" in captured.err
    code = await asyncio.to_thread(client_cli.main, ["", "--address", address])
    assert code == 1 and "INVALID_ARGUMENT: prompt is empty" in capsys.readouterr().err
