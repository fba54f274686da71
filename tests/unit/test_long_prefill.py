"""A long prompt's prefill, cut into passes (prefix-cache blocks here; EXACT_PASS_TOKENS for a
per-token exact int8 target), on the service's model thread: between two of its passes the
thread answers Info and EndSession (brief jobs), and stops the prefill when its caller has
given up (cancelled, past its deadline), ending the session. Before, a 3,000-token prompt whose
client gave up at 3 s held the target's thread for 36 s more: every other request and even
Info waited behind it, and a replica pool took the busy replica for a hung one."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time

import pytest
import torch

from specdec.engine.kv_pool import KVPool, kv_geometry
from specdec.engine.modeling import load_causal_lm
from specdec.rpc.model_thread import CallBatcher, ModelThread
from specdec.sampling.probs import SamplingParams
from target_service.runner import TargetRunner, VerifyCall

BLOCK = 8
PROMPT = [(7 * i + 3) % 40 + 1 for i in range(12 * BLOCK + 3)]  # 12 block passes, then the caller's


@pytest.fixture
def slow_runner(tiny_pair):
    """A target with a prefix cache (its prefill runs block by block), each pass 30 ms slower,
    counting the passes, and the service's hook between them."""
    runner = TargetRunner(
        load_causal_lm(str(tiny_pair.target), "float32", "cpu"),
        max_sessions=8,
        session_ttl_s=60,
        max_speculative_tokens=4,
        prefix_cache_bytes=1 << 24,
        prefix_block_tokens=BLOCK,
    )
    thread = ModelThread("test-target")
    runner.between_passes = thread.between_passes
    runner.passes = 0  # type: ignore[attr-defined]
    plain = runner._forward_admitted

    def slow(*args, **kwargs):
        runner.passes += 1  # type: ignore[attr-defined]
        time.sleep(0.03)
        return plain(*args, **kwargs)

    runner._forward_admitted = slow  # type: ignore[method-assign]
    yield runner, thread
    thread.shutdown()


def call(runner: TargetRunner, session_id: str, tokens: list[int]) -> VerifyCall:
    return VerifyCall(session_id, 0, tokens, [], torch.zeros(0, runner.loaded.vocab_size), SamplingParams(), 0)


async def started(runner, passes: int = 1) -> None:
    while runner.passes < passes:
        await asyncio.sleep(0.005)


async def test_info_and_end_session_are_answered_between_a_prefills_passes(slow_runner):
    runner, thread = slow_runner
    await thread.run(runner.verify_one, call(runner, "other", [5, 6, 7]))
    job = asyncio.ensure_future(thread.run(runner.verify_one, call(runner, "long", PROMPT)))
    await started(runner)
    description = await asyncio.wait_for(thread.run_brief(runner.describe), 1.0)
    assert description.open_sessions == 2
    assert await asyncio.wait_for(thread.run_brief(runner.end_session, "other"), 1.0)
    assert not job.done(), "the prefill ended before the brief jobs were answered"
    assert (await job).sequence_length == len(PROMPT)


@pytest.mark.parametrize("path", ["alone", "batched"])
async def test_a_prefill_whose_caller_gave_up_stops_at_its_next_pass_and_ends_its_session(slow_runner, path):
    """Alone (a job of its own), or as the only call of a batch (the target's batcher, the
    path a verify takes whenever batching is on: the job is the batcher's, and stops once
    every caller of its batch is gone)."""
    runner, thread = slow_runner
    batcher = CallBatcher(thread, runner.verify_batch, 0.002, 4)
    first = call(runner, "long", PROMPT)
    job = asyncio.ensure_future(batcher.submit(first) if path == "batched" else thread.run(runner.verify_one, first))
    await started(runner, 2)
    job.cancel()
    answered = time.perf_counter()
    next_call = await asyncio.wait_for(thread.run(runner.verify_one, call(runner, "next", [5, 6, 7])), 1.0)
    assert time.perf_counter() - answered < 0.5 and next_call.sequence_length == 3
    assert runner.passes <= 4, f"{runner.passes} passes: the prefill ran on for no one"
    assert runner.sessions.ids() == ["next"], "the given-up session was left half prefilled"


async def test_a_prefill_in_a_batch_stops_when_its_own_caller_leaves_and_the_others_go_on(slow_runner):
    """A long prompt batched with another session's call runs its prefill alone first: its
    caller cancelled (the servicer sets VerifyCall.should_stop), it stops at the next pass and
    ends its session, and the other caller is answered at once. Before, only every caller gone
    stopped the job: the whole prefill ran for no one while the other call waited."""
    runner, thread = slow_runner
    batcher = CallBatcher(thread, runner.verify_batch, 0.05, 4)
    stop = threading.Event()
    long = asyncio.ensure_future(
        batcher.submit(dataclasses.replace(call(runner, "long", PROMPT), should_stop=stop.is_set))
    )
    other = asyncio.ensure_future(batcher.submit(call(runner, "other", [5, 6, 7])))
    await started(runner, 2)
    stop.set()
    long.cancel()
    answered = time.perf_counter()
    assert (await asyncio.wait_for(other, 1.0)).sequence_length == 3
    assert time.perf_counter() - answered < 0.3, "the other call waited for the prefill of no one"
    assert runner.passes <= 5, f"{runner.passes} passes: the prefill ran on for no one"
    assert runner.sessions.ids() == ["other"], "the given-up session was left half prefilled"


async def test_a_job_whose_caller_waits_is_not_stopped_by_another_callers_cancellation(slow_runner):
    """Only the running job's own caller stops it: a cancelled call queued behind it is dropped
    without touching it."""
    runner, thread = slow_runner
    job = asyncio.ensure_future(thread.run(runner.verify_one, call(runner, "long", PROMPT)))
    await started(runner)
    queued = asyncio.ensure_future(thread.run(threading.Event().wait, 5))
    await asyncio.sleep(0.01)
    queued.cancel()
    assert (await job).sequence_length == len(PROMPT) and runner.sessions.ids() == ["long"]


async def test_a_given_up_batched_prefill_gives_its_pages_back_without_the_cyclic_collector(slow_runner):
    """The stop is a refusal (CANCELLED) and kept without its traceback, whose frames would
    hold the ended session, and so its pool pages, until the cyclic collector ran."""
    runner, thread = slow_runner
    layers, heads, dim = kv_geometry(runner.model.config)
    runner.pool = KVPool(layers, heads, dim, pages=3, dtype=runner.model.dtype)
    batcher = CallBatcher(thread, runner.verify_batch, 0.002, 4)
    gc.collect()
    gc.disable()
    try:
        job = asyncio.ensure_future(batcher.submit(call(runner, "long", PROMPT)))
        await started(runner, 2)
        job.cancel()
        await asyncio.wait_for(thread.run(lambda: None), 1.0)  # after the stopped job
        await asyncio.sleep(0.05)  # the batcher's task relays its results
        assert runner.sessions.ids() == [] and runner.pool.allocator.free_pages == 3
    finally:
        gc.enable()
