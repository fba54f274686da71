"""Rank 0's TensorParallelRunner and rank 1's replay loop, as two gloo processes on CPU: after
a script of lone and batched verifies, rollbacks, a bad call, a KV-budget eviction, TTL expiry,
EndSession, a target-only call's steps and a session opened by a rank that replays it late,
both ranks hold the same sessions with caches of the same length, and rank 0's
answers equal a single-process TargetRunner's."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.engine.kv_pool import PAGE_TOKENS
from specdec.engine.memory import MemoryShare
from specdec.rpc.ports import free_port
from specdec.sampling.probs import SamplingParams
from target_service.config import TargetConfig
from target_service.runner import VerifyCall
from target_service.server import load_runner
from tests.stack import model_service_config

GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
TTL_S = 1.0
LATE_REPLAY_S = 0.9


def _script(runner, pause) -> list:
    """Returns what each call answered (a Verification's ids, or the error's type)."""
    empty = torch.empty(0)
    answers = []

    def record(result) -> None:
        if isinstance(result, Exception):
            answers.append(type(result).__name__)
        else:
            answers.append((result.recovered_token_ids, result.bonus_token_id, result.sequence_length))

    def call(session_id, keep, new, drafts):
        return VerifyCall(session_id, keep, new, drafts, empty, GREEDY, 0)

    for result in [runner.verify_one(call("a", 0, [5, 6, 7, 8, 9], [10, 11]))]:
        record(result)
    for result in runner.verify_batch(
        [
            call("a", 6, [12], [13, 14]),  # rolls back one draft token
            call("b", 0, [20, 21, 22], [23]),
            call("c", 0, [30, 31], [32, 33, 34]),
            call("b", 4, [25], []),  # the same session twice: runs after its first call
            call("d", 3, [1], []),  # unknown session keeping tokens: NOT_FOUND alone
        ]
    ):
        record(result)
    runner.end_session("c")
    # Grows "b" past the budget: "a", least recently used, is evicted on both ranks.
    record(runner.verify_one(call("b", 5, list(range(40, 80)), [])))
    record(runner.verify_one(call("e", 0, [3, 4], [5])))
    pause(TTL_S + 0.3)
    runner.expire_sessions()  # "b" and "e" are idle past the TTL by now
    record(runner.verify_one(call("f", 0, [7, 8, 9], [1, 2])))
    # A K = 0 call: its first token, then steps in the same job (each step a verify_one).
    first, steps = runner.verify_then_steps(call("g", 0, [4, 5, 6], []), [11, 12, 13], (), lambda: False)
    for result in [first, *steps]:
        record(result)
    # "f" and "g" idle under 1 s (the TTL) as "h" opens: kept, on a rank that replays the
    # call late (LATE_REPLAY_S: past the TTL there) too.
    pause(0.4)
    record(runner.verify_one(call("h", 0, [2, 3], [4])))
    return answers


def _state(runner) -> dict:
    return {sid: (list(s.tokens), s.cached_tokens) for sid, s in runner.sessions._sessions.items()}


def _rank(rank: int, init_method: str, config: TargetConfig, results) -> None:
    from target_service import tensor_parallel

    torch.set_num_threads(1)
    control = tensor_parallel.init_rank(rank, 2, rank, "cpu", init_method)
    runner = load_runner(config)
    if rank == 0:
        tp = tensor_parallel.TensorParallelRunner(runner, control, 2)
        answers = _script(tp, time.sleep)
        tp.stop_workers()
    else:
        replay = runner.verify_one

        def late(call):  # a busy host: this rank replays "h" later than rank 0 ran it
            time.sleep(LATE_REPLAY_S if call.session_id == "h" else 0.0)
            return replay(call)

        runner.verify_one = late
        tensor_parallel.serve_worker(runner, control, rank)
        answers = None
    states = [None, None]
    dist.all_gather_object(states, _state(runner), group=control)
    if rank == 0:
        results.put((answers, states, runner.kv_bytes_per_token, runner.sessions.evicted))
        results.close()
        results.join_thread()  # the answer is in the pipe before this process goes
    dist.barrier(group=control)  # neither rank leaves while the other still uses the group
    # As target_service.tensor_parallel.worker_main does: skip interpreter teardown, whose C++
    # destructors can abort a process whose gloo peer has already gone (seen once under load:
    # "terminate called without an active exception", exit code -6, after all the work was done).
    os._exit(0)


def _two_ranks(rank_main, config: TargetConfig):
    """rank_main(rank, init method, config, queue) as two spawned gloo ranks; what rank 0 put."""
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [context.Process(target=rank_main, args=(rank, init_method, config, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        found = results.get(timeout=240)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [p.exitcode for p in processes] == [0, 0]
    return found


def test_two_gloo_ranks_keep_identical_sessions_and_answer_like_one_process(tiny_pair):
    config = model_service_config(TargetConfig, tiny_pair.target, tensor_parallel=2, session_ttl_s=TTL_S)
    # A budget of 48 tokens (each rank counts its half of the heads; one process all of them):
    # "b" growing to 45 tokens evicts "a" (9 tokens).
    full_token = load_runner(dataclasses.replace(config, tensor_parallel=1)).kv_bytes_per_token
    config = dataclasses.replace(config, max_kv_bytes=48 * full_token // 2)
    alone = load_runner(dataclasses.replace(config, tensor_parallel=1, max_kv_bytes=48 * full_token))
    alone.model.set_attn_implementation("sdpa")  # as the ranks run (per-row attention is for one CPU process)
    expected = _script(alone, time.sleep)

    answers, states, kv_bytes_per_token, evicted = _two_ranks(_rank, config)
    assert answers == expected and len(expected) == 14, "the K = 0 call did not step three times"
    assert "SessionNotFound" in answers and evicted >= 1, "the script never hit NOT_FOUND or an eviction"
    assert states[0] == states[1], "the ranks' sessions diverged"
    assert set(states[0]) == {"f", "g", "h"}, "TTL expiry or EndSession did not reach every rank"
    assert kv_bytes_per_token == full_token // 2


def _budget_rank(rank: int, init_method: str, config: TargetConfig, results) -> None:
    """A rank whose device shows `rank` more MiB free than rank 0's, loading with a share."""
    from specdec.engine import memory
    from target_service import tensor_parallel

    torch.set_num_threads(1)
    control = tensor_parallel.init_rank(rank, 2, rank, "cpu", init_method)
    memory.available_bytes = lambda device: (64 + rank) * 2**20
    runner = load_runner(config)
    budgets = [None, None]
    dist.all_gather_object(budgets, runner.sessions.max_kv_bytes, group=control)
    if rank == 0:
        results.put((budgets, runner.kv_bytes_per_token))
        results.close()
        results.join_thread()
    dist.barrier(group=control)
    os._exit(0)


def test_a_share_of_memory_is_one_budget_on_every_rank(tiny_pair):
    """--max-kv-bytes 50%: each rank measures its own device, and free memory differs between
    cards; the ranks take the least, so each admits and evicts as the others do."""
    config = model_service_config(
        TargetConfig, tiny_pair.target, tensor_parallel=2, max_kv_bytes=MemoryShare(0.5), max_sessions=4
    )
    budgets, per_token = _two_ranks(_budget_rank, config)
    assert budgets[0] == budgets[1] == 32 * 2**20 - 4 * PAGE_TOKENS * per_token  # half of rank 0's 64 MiB
