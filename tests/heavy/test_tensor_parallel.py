"""`--tensor-parallel 2` on CPU (gloo): the target runs as two processes that each hold half
of every layer and half of the KV heads; rank 0 serves and sends every call to rank 1.

If the ranks' sessions ever differed (a call replayed out of order, a session evicted or
expired on one rank only), rank 0 would combine attention over caches of different lengths
and the output would stop being the target's greedy output, so these tests drive sessions
through concurrency, batching, rollback, KV-budget eviction and EndSession (TTL expiry is in
test_tensor_parallel_ranks.py) and compare every output with transformers' greedy output.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoConfig

from specdec.rpc.ports import free_port
from specdec.v1 import common_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import START_TIMEOUT_S, ProcessStack

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "import numpy as np"]
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
TP_ARGS = ["--tensor-parallel", "2", "--threads", "1"]


def _workers_of(pid: int) -> list[int]:
    """The ranks a target process spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def test_tensor_parallel_target_serves_the_greedy_reference_through_eviction_and_ending(tiny_pair, reference, tmp_path):
    # A budget of about 70 tokens of this rank's KV: the four generations below (prompt + 40
    # tokens each) cannot all stay. One coordinator would run them one at a time (it admits a
    # session only where it fits, coordinator.pools); two, each seeing only the other's bytes,
    # run one each at once, so sessions are evicted mid-generation and re-prefilled. Each call
    # runs alone (--batch-window-ms 0): calls sharing a batch spare each other's sessions and
    # refuse the one that does not fit instead (SessionStore.sharing), which on a quick machine,
    # where the two sessions' calls always met, left nothing evicted. The ranks' batched passes:
    # tests/heavy/test_tensor_parallel_ranks.py.
    config = AutoConfig.from_pretrained(tiny_pair.target)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_rank_token = (
        2 * config.num_hidden_layers * (config.num_key_value_heads // 2) * head_dim * 4
    )  # K and V, float32
    budget = 70 * kv_per_rank_token
    target_args = [*TP_ARGS, "--max-kv-bytes", str(budget), "--batch-window-ms", "0"]
    with (
        ProcessStack(tiny_pair, tmp_path, [], target_args) as stack,
        stack.channel() as channel,
        stack.channel("target") as t,
    ):
        target = target_pb2_grpc.TargetStub(t)
        info = target.Info(common_pb2.InfoRequest(), timeout=10)
        assert info.tensor_parallel_size == 2
        assert len(info.weights_fingerprint) == 64 and info.device_kind == "cpu", "rank 0's shard, fingerprinted"
        assert info.kv_bytes_per_token == kv_per_rank_token, "the budget counts one rank's share of the heads"
        assert len(_workers_of(stack.current["target"].process.pid)) == 1, "rank 0 did not start rank 1"

        generate = coordinator_pb2_grpc.CoordinatorStub(channel).Generate
        stack.ports["coordinator"] = free_port()
        stack.start("coordinator").wait_healthy(START_TIMEOUT_S)
        with stack.channel() as second:
            generates = (generate, coordinator_pb2_grpc.CoordinatorStub(second).Generate)
            requests = [
                pb.GenerateRequest(prompt=p, max_new_tokens=40, num_speculative_tokens=k)
                for p, k in zip(PROMPTS, (1, 2, 3, 4))
            ]
            with ThreadPoolExecutor(len(requests)) as pool:
                responses = list(pool.map(lambda i: generates[i % 2](requests[i], timeout=300), range(len(requests))))
        for request, response in zip(requests, responses):
            assert list(response.token_ids) == reference(request.prompt, 40), f"K={request.num_speculative_tokens}"
        assert sum(r.stats.accepted_tokens for r in responses) > 0
        info = target.Info(common_pb2.InfoRequest(), timeout=10)
        assert info.evicted_sessions > 0 and sum(r.stats.reprefills for r in responses) > 0, "the budget never evicted"

        # Sampled generation runs on both ranks too (its draw is rank 0's).
        sampled = generate(
            pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=20, temperature=0.8, top_p=1.0, seed=5), timeout=300
        )
        assert len(sampled.token_ids) == 20

        # Ending a session is rank 0's decision, sent to rank 1: it is gone on both (TTL expiry
        # takes the same path: tests/heavy/test_tensor_parallel_ranks.py).
        ids = list(reference(PROMPTS[1], 3))
        target.Verify(
            target_pb2.VerifyRequest(session_id="left-open", keep_tokens=0, new_tokens=ids, sampling=GREEDY), timeout=30
        )
        assert target.EndSession(common_pb2.EndSessionRequest(session_id="left-open"), timeout=30).existed
        assert not target.Info(common_pb2.InfoRequest(), timeout=10).open_sessions
        with pytest.raises(grpc.RpcError) as gone:
            target.Verify(
                target_pb2.VerifyRequest(session_id="left-open", keep_tokens=len(ids), new_tokens=[1], sampling=GREEDY),
                timeout=30,
            )
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND

        # After an end, eviction and a NOT_FOUND, the ranks still agree.
        again = generate(
            pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=40, num_speculative_tokens=3), timeout=300
        )
        assert list(again.token_ids) == reference(PROMPTS[2], 40)


def test_a_dead_tensor_parallel_rank_stops_the_target_which_comes_back_whole(tiny_pair, reference, tmp_path):
    with (
        ProcessStack(tiny_pair, tmp_path, ["--connect-timeout", "120"], TP_ARGS) as stack,
        stack.channel() as channel,
    ):
        generate = coordinator_pb2_grpc.CoordinatorStub(channel).Generate
        request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=30, num_speculative_tokens=2)
        assert list(generate(request, timeout=120).token_ids) == reference(PROMPTS[0], 30)

        target = stack.current["target"].process
        (worker,) = _workers_of(target.pid)
        subprocess.run(["kill", "-9", str(worker)], check=True)
        assert target.wait(timeout=15) == 3, "rank 0 went on without rank 1"

        stack.start("target").wait_healthy(START_TIMEOUT_S)
        response = generate(request, timeout=120)
        assert list(response.token_ids) == reference(PROMPTS[0], 30)


def test_tensor_parallel_that_does_not_divide_the_heads_refuses_to_start(tiny_pair, tmp_path):
    from specdec.rpc.ports import free_port
    from specdec.tools.launch import spawn

    process = spawn(
        "target",
        "target_service",
        ["--model", str(tiny_pair.target), "--tensor-parallel", "3"],
        free_port(),
        tmp_path / "t.log",
    )
    try:
        assert process.process.wait(timeout=120) != 0
    finally:
        process.stop()
    assert "must divide the attention heads (4) and the KV heads (2)" in (tmp_path / "t.log").read_text()
