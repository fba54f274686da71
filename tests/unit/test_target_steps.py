"""Target-only steps in one job of the model thread (TargetRunner.verify_steps, and with the
call before them verify_then_steps): the tokens single calls give, and the job yields to a
call that queues behind it."""

from __future__ import annotations

import asyncio
import threading

import torch

from specdec.rpc.model_thread import ModelThread
from specdec.sampling.probs import SamplingParams
from target_service.runner import VerifyCall

SAMPLED = SamplingParams(temperature=0.9)
PROMPT = [10, 20, 30, 40]


def first_call(runner, session_id: str) -> VerifyCall:
    return VerifyCall(session_id, 0, PROMPT, [], torch.zeros(0, runner.loaded.vocab_size), SAMPLED, 10)


def single_calls(runner, session_id: str, seeds: list[int]) -> list[int]:
    """What one Verify call per step gives: the reference for the stepped job."""
    first = first_call(runner, session_id)
    last = runner.verify_one(first)
    tokens = [last.bonus_token_id]
    for seed in seeds:
        call = VerifyCall(session_id, last.sequence_length, [last.bonus_token_id], [], first.draft_probs, SAMPLED, seed)
        last = runner.verify_one(call)
        tokens.append(last.bonus_token_id)
    runner.end_session(session_id)
    return tokens


def test_steps_in_one_job_give_the_single_calls_tokens_and_stop_before_a_stop_token(target_runner):
    seeds = [11, 12, 13, 14, 15]
    expected = single_calls(target_runner, "ref", seeds)
    first = first_call(target_runner, "job")
    after = target_runner.verify_one(first)
    steps = target_runner.verify_steps(first, after, seeds, set(), lambda: False)
    assert [after.bonus_token_id] + [step.bonus_token_id for step in steps] == expected
    assert steps[-1].sequence_length == len(PROMPT) + len(seeds)
    target_runner.end_session("job")

    after = target_runner.verify_one(first)
    steps = target_runner.verify_steps(first, after, seeds, {expected[2]}, lambda: False)
    assert [step.bonus_token_id for step in steps] == expected[1:3]  # fed nothing after the stop token
    target_runner.end_session("job")

    # The call and its steps in one job (a K = 0 call's first token too): the same tokens.
    after, steps = target_runner.verify_then_steps(first, seeds, set(), lambda: False)
    assert [after.bonus_token_id] + [step.bonus_token_id for step in steps] == expected
    target_runner.end_session("job")

    # A call waiting (or this one cancelled) by the end of the first token: the steps are left to the caller.
    after, steps = target_runner.verify_then_steps(first, seeds, set(), lambda: True)
    assert after.bonus_token_id == expected[0] and steps == []
    target_runner.end_session("job")


async def test_a_stepping_job_yields_after_its_step_when_another_call_queues(target_runner):
    """A job of 40 steps holds at its first step until a second call has queued behind it,
    then returns that one step; the caller runs the rest (here: as the next job)."""
    seeds = list(range(100, 140))
    expected = single_calls(target_runner, "ref", seeds)
    thread = ModelThread("test-target")
    first = first_call(target_runner, "job")
    after = target_runner.verify_one(first)
    at_first_step, go_on = threading.Event(), threading.Event()
    verify_one = target_runner.verify_one

    def held(call):  # the first step waits until the other call has queued
        at_first_step.set()
        go_on.wait(10)
        return verify_one(call)

    target_runner.verify_one = held
    try:
        job = asyncio.ensure_future(thread.run(target_runner.verify_steps, first, after, seeds, set(), thread.queued))
        await asyncio.to_thread(at_first_step.wait, 10)
        target_runner.verify_one = verify_one
        other = asyncio.ensure_future(thread.run(lambda: "other"))
        await asyncio.sleep(0)  # the task submits its job
        assert thread.queued()
        go_on.set()
        steps = await job
        assert len(steps) == 1 and await other == "other" and not thread.queued()
        rest = await thread.run(target_runner.verify_steps, first, steps[-1], seeds[1:], set(), thread.queued)
    finally:
        target_runner.verify_one = verify_one
        go_on.set()
        thread.shutdown()
    assert [after.bonus_token_id] + [step.bonus_token_id for step in steps + rest] == expected
    target_runner.end_session("job")
