"""The single model thread every runner call goes through (ModelThread), so the event loop
keeps serving health checks and cancellations while a forward pass runs, and the batcher
(CallBatcher) that gathers calls from several sessions into one batched runner call on it."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from specdec.errors import JobGivenUp

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")  # a call a batcher gathers
R = TypeVar("R")  # what one call returns


PR_SET_NAME = 15  # prctl(2): the calling thread's name, 15 bytes at most


def name_os_thread(name: str) -> None:
    """Gives the calling thread `name` as its operating system's name too (Python's thread
    names stay inside Python), so `top -H`, /proc's comm and native profilers tell the model
    thread from the event loop and gRPC's threads. Linux only; elsewhere it does nothing."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here (not Linux)
        pass


class ModelThread:
    """Runs runner calls one at a time on a dedicated thread, so the event loop keeps serving
    health checks and cancellations while a forward pass runs, and runner state is only ever
    touched from one thread. The thread carries `name` as its OS name (`name_os_thread`)."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=name_os_thread, initargs=(name,)
        )
        # Each counter has one writer (the event loop; the model thread; whoever cancels a job,
        # the event loop or shutdown), so reading them from any thread needs no lock.
        self._submitted = 0
        self._started = 0
        self._dropped = 0  # cancelled before they started: they never will
        self._brief: deque[tuple[Callable, tuple, asyncio.AbstractEventLoop, asyncio.Future]] = deque()  # run_brief
        self._given_up: Callable[[], bool] | None = None  # the running job's: no caller waits for it any more

    async def run(self, fn: Callable[..., T], *args: Any, given_up: Callable[[], bool] | None = None) -> T:
        """`fn(*args)` on the thread, in its turn. A caller that stops waiting (cancelled: its
        client gave up) drops the job if it has not started, and stops it at its next
        `between_passes` if it has; so does `given_up()` turning true (a batch's callers all gone),
        which also drops a job it finds true in its turn (a batch queued behind a frozen or long
        job whose callers all left meanwhile runs no pass)."""
        self._submitted += 1
        cancelled = threading.Event()
        job = self._executor.submit(
            self._start, fn, args, cancelled.is_set if given_up is None else lambda: cancelled.is_set() or given_up()
        )
        job.add_done_callback(self._count_dropped)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def _start(self, fn: Callable[..., T], args: tuple, given_up: Callable[[], bool]) -> T:
        self._started += 1
        if given_up():  # its callers left while it waited its turn (a batch's all, or it was cancelled as it began)
            raise JobGivenUp("the caller stopped waiting for this call before it started")
        self._given_up = given_up
        try:
            return fn(*args)
        finally:
            self._given_up = None

    def between_passes(self, session: object = None) -> None:
        """On the thread, between two passes of one job (a long prompt's prefill of `session`,
        which specdec.engine.batching.stopping reads): answers the
        brief jobs waiting (Info, EndSession), and stops the job (JobGivenUp) if its caller
        no longer waits for it, rather than run its remaining passes for no one while every
        other call waits behind them."""
        self.run_brief_jobs()
        if self._given_up is not None and self._given_up():
            raise JobGivenUp("the caller stopped waiting for this call (cancelled or past its deadline)")

    def _count_dropped(self, job: Future) -> None:
        if job.cancelled():
            self._dropped += 1

    def queued(self) -> bool:
        """Some call waits for the thread: a job that runs many steps yields to it."""
        return self._submitted > self._started + self._dropped or bool(self._brief)

    async def run_brief(self, fn: Callable[..., T], *args: Any) -> T:
        """`run` for a short job that runs no forward pass (EndSession, Info). A job that steps
        a batch on the thread runs it between two passes (`run_brief_jobs`), and its caller is
        answered then, rather than the batch ending first; with none running, it runs as `run`
        would, in its turn."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._brief.append((fn, args, loop, future))
        self._executor.submit(self.run_brief_jobs)
        return await future

    def run_brief_jobs(self) -> None:
        """On the model thread: runs every brief job waiting, in order, and answers each."""
        while True:
            try:
                fn, args, loop, future = self._brief.popleft()
            except IndexError:
                return
            try:
                outcome, failed = fn(*args), False
            except Exception as exc:  # noqa: BLE001 - raised in its caller
                outcome, failed = exc, True
            try:
                loop.call_soon_threadsafe(_resolve, future, outcome, failed)
            except RuntimeError:  # the loop has closed (shutdown): no caller is left to answer
                pass

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# A session used this recently is mid-generation (between its rounds) and likely to call again
# within a batch window; one idle longer (a client between requests, a session not yet ended)
# is not waited for: a lone active session's calls then run at once, whatever else is open.
ACTIVE_SESSION_S = 1.0


class CallBatcher(Generic[C, R]):
    """Gathers calls for one batched runner method and runs them on the model thread together.

    A batch starts `window_s` after the oldest waiting call arrived or the previous batch
    ended, whichever is later; earlier when `max_size` are waiting or when
    `more_expected(waiting)` says no other caller could join (e.g. every recently active
    session already has a call waiting, so a lone session never waits). Calls that queue while a batch runs
    go in the next one. Counting the window from the end of the previous batch lets the
    callers that batch just answered come back in time to join: without it, two sessions
    alternate forever, each one's call running alone while the other's is in flight.
    `run_batch(calls)` returns, per call, a result or the exception to raise in that caller
    alone. A caller cancelled before its batch starts is left out of it.

    With `answers_early`, `run_batch(calls, answer)` may also hand a call its result as soon
    as that call is done, `answer(index, result)` from the model thread, while the batch goes
    on with the others (a draft batch steps until its longest call is done): that caller goes
    on to its next call, and a batch's shortest calls no longer wait for its longest.

    With `joins` (and early answers), `run_batch(calls, answer, join)` may also take the calls
    that arrive while it runs: `join(held)`, from the model thread between its passes, hands
    over those waiting, oldest first (those it had no room for at its start come before any
    that arrived since), at most `max_size - held`, and the j-th call taken is index
    len(calls) + j of `answer` and of the results. Calls no batch took run in the next one.
    It takes none while another job waits for the model thread (`ModelThread.queued`), so a
    batch that others keep joining still ends and lets it run.
    """

    def __init__(
        self,
        model_thread: ModelThread,
        run_batch: Callable[..., list[R | Exception]],
        window_s: float,
        max_size: int,
        more_expected: Callable[[int], bool] = lambda waiting: True,
        answers_early: bool = False,
        joins: bool = False,
    ) -> None:
        if window_s < 0 or max_size < 1:
            raise ValueError(f"a batch window must be >= 0 s and a batch size >= 1; got {window_s} s and {max_size}")
        if joins and not answers_early:
            raise ValueError("a batch that calls join must answer them early: it may not end for a while")
        self._model_thread = model_thread
        self._run_batch = run_batch
        self._window_s = window_s
        self._max_size = max_size
        self._more_expected = more_expected
        self._answers_early = answers_early
        self._joins = joins
        self._waiting: list[tuple[C, asyncio.Future, float]] = []  # (call, its future, when it arrived)
        # Calls the running batch may take (joins): guarded by the lock, as the model thread takes them.
        self._lock = threading.Lock()
        self._joinable: list[tuple[C, asyncio.Future, float]] | None = None  # None: no batch takes calls now
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Task | None = None
        self._idle_since = float("-inf")  # loop time the previous batch ended

    async def submit(self, call: C) -> R:
        (result,) = await self.submit_all([call])
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_all(self, calls: list[C]) -> list[R | Exception]:
        """Several calls at once, in order: the next batch takes them together, or the running
        one as it has room (oldest first). → per call, its result or the exception it failed with."""
        loop = asyncio.get_running_loop()
        entries = [(call, loop.create_future(), loop.time()) for call in calls]
        with self._lock:
            joinable = self._joinable is not None
            if joinable:
                self._joinable.extend(entries)  # type: ignore[union-attr]
        if not joinable:
            self._waiting.extend(entries)
            self._schedule()
        return list(await asyncio.gather(*(future for _, future, _ in entries)))

    def _schedule(self) -> None:
        if self._running is not None:
            return  # the batch that is running starts the next one when it ends
        self._waiting = [entry for entry in self._waiting if not entry[1].done()]
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        wait_s = max(self._waiting[0][2], self._idle_since) + self._window_s - loop.time()
        if len(self._waiting) >= self._max_size or wait_s <= 0 or not self._more_expected(len(self._waiting)):
            self._start()
        elif self._timer is None:
            self._timer = loop.call_later(wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting[: self._max_size], self._waiting[self._max_size :]
        if self._joins:
            # From now on calls go to the batch that starts here, behind those it had no room
            # for: it takes them oldest first, and any it leaves run next, in the same order.
            with self._lock:
                self._joinable, self._waiting = self._waiting, []
        self._running = asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[C, asyncio.Future, float]]) -> None:
        loop = asyncio.get_running_loop()
        calls, futures = [call for call, _, _ in batch], [future for _, future, _ in batch]

        def answer(index: int, result: R | Exception) -> None:  # on the model thread
            try:
                loop.call_soon_threadsafe(_settle, futures[index], result)
            except RuntimeError:  # the loop has closed (shutdown): no caller is left to answer
                pass

        def join(held: int) -> list[C]:  # on the model thread, between passes
            self._model_thread.run_brief_jobs()
            if self._model_thread.queued():
                return []
            room = max(0, self._max_size - held)
            with self._lock:
                waiting = [entry for entry in self._joinable or () if not entry[1].done()]
                taken, self._joinable = waiting[:room], waiting[room:]
            futures.extend(future for _, future, _ in taken)
            return [call for call, _, _ in taken]

        try:
            extra = (answer, join) if self._joins else (answer,) if self._answers_early else ()
            # Its callers all gone (cancelled; answered early), a prefill in it stops between passes.
            results: list = await self._model_thread.run(
                self._run_batch, calls, *extra, given_up=lambda: all(future.done() for future in futures)
            )
        except BaseException as exc:  # noqa: BLE001 - the callers get it; this task only relays
            results = [exc] * len(futures)
        finally:
            with self._lock:
                left, self._joinable = self._joinable or [], None
            # In the order they arrived: with joins, every call waits in `_joinable` while one runs.
            self._waiting = left + self._waiting
            self._running = None
            # The next window waits for this batch's callers to come back; a batch that answered
            # no one (its callers all left, so it ran nothing or stopped) has none coming.
            if not all(future.cancelled() for future in futures):
                self._idle_since = loop.time()
        for future, result in zip(futures, results):
            _settle(future, result)  # a call answered early keeps that answer
        self._schedule()


def _resolve(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    """A brief job's outcome to its caller: the value, or the exception it raises there."""
    if future.done():
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _settle(future: asyncio.Future, result: Any) -> None:
    """A batched call's result to its caller: the value, or the exception it raises there."""
    if future.done():
        return
    if isinstance(result, asyncio.CancelledError):
        future.cancel()
    elif isinstance(result, BaseException) and not isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
