"""CallBatcher: which calls share a batch, and that each caller gets its own result or error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specdec.errors import InvalidArgument
from specdec.rpc.model_thread import CallBatcher, ModelThread


class Recorder:
    """A batched method that doubles numbers, refuses negative ones, and can be held busy."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, calls: list[int]) -> list[int | Exception]:
        self.release.wait(5)
        self.batches.append(list(calls))
        return [InvalidArgument(f"{call} is negative") if call < 0 else 2 * call for call in calls]


@pytest.fixture
def model_thread():
    thread = ModelThread("test-model")
    yield thread
    thread.shutdown()


async def test_calls_within_the_window_share_one_batch_and_get_their_own_results(model_thread):
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=0.05, max_size=8)
    results = await asyncio.gather(*(batcher.submit(n) for n in (1, -2, 3)), return_exceptions=True)
    assert recorder.batches == [[1, -2, 3]]
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], InvalidArgument) and "-2 is negative" in str(results[1])


async def test_a_full_batch_starts_without_waiting_for_the_window(model_thread):
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=30.0, max_size=3)
    results = await asyncio.wait_for(asyncio.gather(*(batcher.submit(n) for n in range(3))), timeout=5)
    assert results == [0, 2, 4] and recorder.batches == [[0, 1, 2]]


async def test_batches_hold_at_most_max_size_and_keep_arrival_order(model_thread):
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=0.01, max_size=4)
    results = await asyncio.gather(*(batcher.submit(n) for n in range(10)))
    assert results == [2 * n for n in range(10)]
    assert [n for batch in recorder.batches for n in batch] == list(range(10))
    assert max(len(batch) for batch in recorder.batches) == 4


async def test_calls_that_arrive_while_a_batch_runs_go_together_next(model_thread):
    recorder = Recorder()
    recorder.release.clear()
    batcher = CallBatcher(model_thread, recorder, window_s=0.001, max_size=8)
    first = asyncio.ensure_future(batcher.submit(100))
    await asyncio.sleep(0.05)  # the first batch is running (held on the model thread)
    later = [asyncio.ensure_future(batcher.submit(n)) for n in range(5)]
    await asyncio.sleep(0.05)  # far longer than the window: they still wait for the model
    recorder.release.set()
    assert await first == 200 and await asyncio.gather(*later) == [0, 2, 4, 6, 8]
    assert recorder.batches == [[100], [0, 1, 2, 3, 4]]


async def test_a_caller_answered_by_one_batch_can_join_the_next(model_thread):
    """Two sessions in lockstep: the call that queued during a batch waits the window again
    after it, so the caller that batch answered comes back in time to share the next pass."""
    recorder = Recorder()
    recorder.release.clear()
    batcher = CallBatcher(model_thread, recorder, window_s=0.2, max_size=8)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.3)  # the first batch started after its window and is held running
    queued = asyncio.ensure_future(batcher.submit(2))  # waits longer than the window during the run
    await asyncio.sleep(0.3)
    recorder.release.set()
    assert await first == 2
    returning = asyncio.ensure_future(batcher.submit(3))  # the answered caller's next call
    assert await queued == 4 and await returning == 6
    assert recorder.batches == [[1], [2, 3]]


async def test_a_caller_cancelled_before_its_batch_starts_is_left_out(model_thread):
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=0.05, max_size=8)
    kept = asyncio.ensure_future(batcher.submit(1))
    dropped = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    dropped.cancel()
    assert await kept == 2
    assert recorder.batches == [[1]]


async def test_a_failed_batch_fails_every_call_in_it(model_thread):
    def broken(calls):
        raise RuntimeError("the model fell over")

    batcher = CallBatcher(model_thread, broken, window_s=0.01, max_size=8)
    results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
    assert all(isinstance(result, RuntimeError) for result in results)


def test_window_and_size_are_checked(model_thread):
    with pytest.raises(ValueError, match="batch size >= 1"):
        CallBatcher(model_thread, Recorder(), window_s=0.001, max_size=0)


async def test_no_wait_when_no_other_caller_can_join(model_thread):
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=30.0, max_size=8, more_expected=lambda waiting: waiting < 2)
    assert await asyncio.wait_for(asyncio.gather(batcher.submit(1), batcher.submit(2)), timeout=5) == [2, 4]
    assert recorder.batches == [[1, 2]]


async def test_calls_submitted_together_start_one_batch_in_their_order(model_thread):
    """submit_all (a ProposeBranches call's branches): where a lone call would start a batch at
    once (no other caller expected), the calls given together still share it, in their order,
    and each gets its own result or error."""
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=30.0, max_size=8, more_expected=lambda waiting: False)
    results = await asyncio.wait_for(batcher.submit_all([3, -1, 2]), timeout=5)
    assert recorder.batches == [[3, -1, 2]]
    assert results[0] == 6 and isinstance(results[1], InvalidArgument) and results[2] == 4


async def test_a_batch_whose_callers_all_left_while_it_waited_for_the_thread_runs_nothing(model_thread):
    """A batch handed to the model thread behind another job (a long one, or a process frozen
    and resumed) whose callers all gave up meanwhile is dropped when its turn comes: no pass
    runs for no one, and the next call runs as usual."""
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=0.0, max_size=8)
    release = threading.Event()
    busy = asyncio.ensure_future(model_thread.run(release.wait, 5))
    await asyncio.sleep(0.05)
    callers = [asyncio.ensure_future(batcher.submit(n)) for n in (1, 2)]
    await asyncio.sleep(0.05)
    assert batcher._running is not None  # the batch is on the thread's queue, behind `busy`
    for caller in callers:
        caller.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await busy
    for caller in callers:
        with pytest.raises(asyncio.CancelledError):
            await caller
    assert await batcher.submit(3) == 6
    assert recorder.batches == [[3]]
    assert not model_thread.queued()


async def test_calls_queued_behind_a_batch_whose_callers_all_left_do_not_wait_another_window(model_thread):
    """The window after a batch is for its callers to come back; one that answered no one
    has none coming, so the calls that queued behind it start as soon as it is dropped."""
    recorder = Recorder()
    batcher = CallBatcher(model_thread, recorder, window_s=1.0, max_size=8, more_expected=lambda waiting: waiting < 2)
    release = threading.Event()
    busy = asyncio.ensure_future(model_thread.run(release.wait, 5))
    await asyncio.sleep(0.05)
    left = [asyncio.ensure_future(batcher.submit(n)) for n in (1, 2)]  # two waiting: the batch starts at once
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(batcher.submit(3))  # behind the running batch, its window passing
    for caller in left:
        caller.cancel()
    await asyncio.sleep(1.1)
    release.set()
    assert await asyncio.wait_for(queued, 0.5) == 6  # a second window would be 1 s
    assert await busy and recorder.batches == [[3]]


async def test_a_job_cancelled_before_it_started_no_longer_counts_as_queued(model_thread):
    """ModelThread.queued: a caller cancelled while its job waited leaves nothing queued, so a
    stepping job (TargetRunner.verify_steps) is not told to yield forever after."""
    release = threading.Event()
    busy = asyncio.ensure_future(model_thread.run(release.wait, 5))
    waiting = asyncio.ensure_future(model_thread.run(lambda: "never"))
    await asyncio.sleep(0.05)
    assert model_thread.queued()
    waiting.cancel()
    await asyncio.sleep(0)  # the cancellation reaches the job
    release.set()
    assert await busy
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not model_thread.queued()
    assert await model_thread.run(lambda: "next") == "next" and not model_thread.queued()


async def test_a_call_answered_early_returns_while_its_batch_runs_on_and_keeps_that_answer(model_thread):
    """answers_early: run_batch hands call 0 its result, then holds the batch; call 0's caller
    has it before the batch ends, and the batch's own (later) result for it does not replace it."""
    release = threading.Event()

    def run_batch(calls: list[int], answer) -> list[int | Exception]:
        answer(0, 10 * calls[0])
        release.wait(5)
        return [InvalidArgument("too late")] + [2 * call for call in calls[1:]]

    batcher = CallBatcher(model_thread, run_batch, window_s=0.01, max_size=8, answers_early=True)
    first, second = (asyncio.ensure_future(batcher.submit(n)) for n in (1, 2))
    assert await asyncio.wait_for(first, timeout=5) == 10
    assert not second.done()
    release.set()
    assert await asyncio.wait_for(second, timeout=5) == 4
    assert first.result() == 10


async def test_calls_arriving_while_a_joining_batch_runs_are_handed_to_it_up_to_its_size(model_thread):
    """joins: a call submitted while run_batch runs comes out of join(held) (at most max_size -
    held), is answered through `answer` at index len(calls) + j, and one it did not take runs
    in the next batch."""
    arrived, batches = threading.Event(), []

    def run_batch(calls: list[int], answer, join) -> list[int | Exception]:
        batches.append(list(calls))
        if len(batches) == 1:
            arrived.wait(5)
            taken = join(1)  # room for one of the two waiting
            calls = calls + taken
            assert join(2) == []  # full
            answer(1, 2 * taken[0])
        return [2 * call for call in calls]

    batcher = CallBatcher(model_thread, run_batch, window_s=0.0, max_size=2, answers_early=True, joins=True)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.05)  # the batch runs, waiting
    late = [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3)]
    await asyncio.sleep(0)
    arrived.set()
    assert await asyncio.wait_for(asyncio.gather(first, *late), timeout=5) == [2, 4, 6]
    assert batches == [[1], [3]]


async def test_calls_a_joining_batch_had_no_room_for_go_before_those_that_arrive_while_it_runs(model_thread):
    """joins: the calls beyond max_size when a batch starts are older than any that arrive
    while it runs, so join hands them over first, and the next batch takes them first. (They
    once went behind: with callers coming back as fast as they were answered, the same
    max_size callers kept going first and the rest starved until their deadlines.)"""
    holds, batches, joined = [threading.Event(), threading.Event()], [], []

    def run_batch(calls: list[int], answer, join) -> list[int | Exception]:
        batches.append(list(calls))
        if len(batches) <= 2:
            holds[len(batches) - 1].wait(5)
        if len(batches) == 2:
            joined.extend(join(1))
            calls = calls + joined
        return [2 * call for call in calls]

    batcher = CallBatcher(model_thread, run_batch, window_s=0.0, max_size=2, answers_early=True, joins=True)
    calls = [asyncio.ensure_future(batcher.submit(1))]
    await asyncio.sleep(0.05)  # the batch of 1 runs, held
    calls += [asyncio.ensure_future(batcher.submit(n)) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    holds[0].set()
    await asyncio.sleep(0.05)  # 2 and 3 run, held; 4 had no room
    calls += [asyncio.ensure_future(batcher.submit(n)) for n in (5, 6)]
    await asyncio.sleep(0)
    holds[1].set()
    assert await asyncio.wait_for(asyncio.gather(*calls), timeout=5) == [2, 4, 6, 8, 10, 12]
    assert batches == [[1], [2, 3], [5, 6]] and joined == [4]


async def test_a_joining_batch_takes_no_call_while_another_job_waits_for_the_model_thread(model_thread):
    """So a batch that callers keep joining still ends, and the job behind it runs."""
    arrived, seen = threading.Event(), []

    def run_batch(calls: list[int], answer, join) -> list[int | Exception]:
        if not seen:
            arrived.wait(5)
            seen.append(join(0))
        return [2 * call for call in calls]

    batcher = CallBatcher(model_thread, run_batch, window_s=0.0, max_size=8, answers_early=True, joins=True)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.05)
    other = asyncio.ensure_future(model_thread.run(lambda: "other job"))
    late = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    arrived.set()
    assert await asyncio.wait_for(asyncio.gather(first, other, late), timeout=5) == [2, "other job", 4]
    assert seen == [[]]


def test_a_batch_that_takes_joiners_must_answer_early(model_thread):
    with pytest.raises(ValueError, match="answer"):
        CallBatcher(model_thread, lambda calls: calls, window_s=0.01, max_size=2, joins=True)


async def test_a_brief_job_runs_between_a_joining_batchs_passes_and_its_caller_hears_at_once(model_thread):
    """EndSession and Info (ModelThread.run_brief) run at the running batch's next join, not
    after it ends, and the batch goes on taking calls: they are no reason to drain it."""
    arrived, release, seen = threading.Event(), threading.Event(), []

    def run_batch(calls: list[int], answer, join) -> list[int | Exception]:
        if not seen:  # the first batch
            arrived.wait(5)
            seen.append(join(1))  # runs the brief job first
            release.wait(5)
            calls = calls + seen[0]
        return [2 * call for call in calls]

    batcher = CallBatcher(model_thread, run_batch, window_s=0.0, max_size=8, answers_early=True, joins=True)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.05)
    brief = asyncio.ensure_future(model_thread.run_brief(lambda: "ended"))
    late = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    arrived.set()
    assert await asyncio.wait_for(brief, timeout=5) == "ended"
    assert not first.done()  # the batch still runs
    release.set()
    assert await asyncio.wait_for(asyncio.gather(first, late), timeout=5) == [2, 4]
    assert seen == [[2]]  # the brief job did not stop the batch taking the call behind it


async def test_a_brief_job_with_no_batch_running_runs_in_turn_and_raises_in_its_caller(model_thread):
    order: list[str] = []
    first = asyncio.ensure_future(model_thread.run(lambda: order.append("job")))

    def refuse() -> None:
        order.append("brief")
        raise InvalidArgument("no such session")

    with pytest.raises(InvalidArgument, match="no such session"):
        await asyncio.wait_for(model_thread.run_brief(refuse), timeout=5)
    await first
    assert order == ["job", "brief"] and not model_thread.queued()
