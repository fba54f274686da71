"""A broken model or a malformed proposal fails the request with a clear error instead of
silently changing the output (issue 17, guards): NaN logits on either model, a proposed
token its own distribution gives probability 0, and a distribution whose mass is not 1. The
services keep serving afterwards."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import local_stack

PROMPT = [5, 9, 14, 20]


def request(temperature: float) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=6, num_speculative_tokens=2, temperature=temperature, seed=3
    )


def nan_logits(model) -> None:
    """Makes every forward pass of `model` return NaN logits (a broken checkpoint)."""
    plain = model.forward

    def forward(*args, **kwargs):
        out = plain(*args, **kwargs)
        out.logits = torch.full_like(out.logits, float("nan"))
        return out

    model.forward = forward


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("role", ["target", "draft"])
async def test_nan_logits_fail_the_request_clearly_and_the_stack_keeps_serving(tiny_pair, role, temperature):
    async with local_stack(tiny_pair) as stack:
        good = await stack.stub.Generate(request(temperature), timeout=60)
        runner = stack.target_runner if role == "target" else stack.draft_runner
        plain = runner.model.forward
        nan_logits(runner.model)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stack.stub.Generate(request(temperature), timeout=60)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert "NaN or infinite logits" in raised.value.details() and role in raised.value.details()
        runner.model.forward = plain
        again = await stack.stub.Generate(request(temperature), timeout=60)
    assert list(again.token_ids) == list(good.token_ids)


async def refused_with_rows(tiny_pair, rows) -> grpc.aio.AioRpcError:
    """A sampled request's error while the draft ships `rows(proposal)` instead of the rows it
    drew from; the stack serves the next request once the draft ships its own again."""
    async with local_stack(tiny_pair) as stack:
        runner = stack.draft_runner
        plain_finish = runner._finish

        def shipped(drafting):
            proposal = plain_finish(drafting)
            return dataclasses.replace(proposal, probs=rows(proposal))

        runner._finish = shipped
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stack.stub.Generate(request(1.0), timeout=60)
        runner._finish = plain_finish
        await stack.stub.Generate(request(1.0), timeout=60)
    return raised.value


async def test_a_proposed_token_with_draft_probability_zero_is_refused(tiny_pair):
    def zero_own_token(proposal):
        """The distribution sent gives the proposed tokens no mass: u * 0 < p would accept them always."""
        probs = proposal.probs.clone()  # [K, V]
        probs[torch.arange(len(proposal.token_ids)), torch.tensor(proposal.token_ids)] = 0.0
        return probs / probs.sum(dim=-1, keepdim=True)

    error = await refused_with_rows(tiny_pair, zero_own_token)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "with probability 0.0 under the distribution it sent" in error.details()


async def test_a_proposal_row_that_is_not_a_distribution_fails_the_request(tiny_pair):
    """Rows the draft forgot to normalise would bias every acceptance test without a trace; the
    target refuses them and the request fails, naming why."""
    error = await refused_with_rows(tiny_pair, lambda proposal: proposal.probs * 1.5)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "draft distribution 0 sums to 1.5, not 1" in error.details()
