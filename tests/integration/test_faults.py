"""Node faults with real processes: the draft dies mid-generation and comes back."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from specdec.launch import free_port, spawn
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120
PROMPT = "The quick brown fox"


def start(name: str, module: str, args: list[str], port: int, logs: Path):
    return spawn(name, module, args, port, logs / f"{name}.log", env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)


def test_draft_death_falls_back_to_target_only_and_speculation_resumes_when_it_returns(tiny_pair, reference, tmp_path):
    draft_port = free_port()
    draft_args = ["--model", str(tiny_pair.draft), "--quantize", "none"]
    draft = start("draft", "draft_service", draft_args, draft_port, tmp_path)
    target = start("target", "target_service", ["--model", str(tiny_pair.target)], free_port(), tmp_path)
    processes = [draft, target]
    try:
        draft.wait_healthy(START_TIMEOUT_S)
        target.wait_healthy(START_TIMEOUT_S)
        coordinator = start(
            "coordinator", "coordinator",
            ["--draft", draft.address, "--target", target.address, "--tokenizer", str(tiny_pair.target),
             "--breaker-failures", "2", "--breaker-probe-interval", "0.3", "--draft-timeout", "5"],
            free_port(), tmp_path,
        )
        processes.append(coordinator)
        coordinator.wait_healthy(START_TIMEOUT_S)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=200, num_speculative_tokens=4)

            # The draft is killed after the first round; the generation goes on target-only.
            stream = stub.GenerateStream(request, timeout=60)
            chunks = [next(stream)]
            draft.process.kill()
            draft.process.wait()
            chunks += list(stream)
            assert [t for chunk in chunks for t in chunk.token_ids] == reference(PROMPT, 200)
            stats = chunks[-1].stats
            assert stats.degraded and stats.draft_failures >= 1 and stats.fallback_rounds > 0
            assert stats.accepted_tokens > 0, "the first round(s) should have speculated"

            # With the breaker open, the next request does not wait on the dead draft at all.
            short = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40, num_speculative_tokens=4)
            degraded = stub.Generate(short, timeout=60)
            assert list(degraded.token_ids) == reference(PROMPT, 40)
            assert degraded.stats.degraded and degraded.stats.proposed_tokens == 0 and degraded.stats.draft_failures == 0

            # The draft comes back on its address: a health probe closes the breaker.
            draft = start("draft-again", "draft_service", draft_args, draft_port, tmp_path)
            processes.append(draft)
            draft.wait_healthy(START_TIMEOUT_S)
            deadline = time.monotonic() + 30
            while True:
                response = stub.Generate(short, timeout=60)
                assert list(response.token_ids) == reference(PROMPT, 40)
                if not response.stats.degraded:
                    break
                assert time.monotonic() < deadline, "speculation never resumed after the draft came back"
                time.sleep(0.2)
            assert response.stats.accepted_tokens > 0 and response.stats.draft_failures == 0
    finally:
        for process in reversed(processes):
            process.stop()


def test_target_restart_is_reprefilled_and_a_dead_target_is_unavailable_within_the_deadline(tiny_pair, reference, tmp_path):
    target_port = free_port()
    target_args = ["--model", str(tiny_pair.target)]
    draft = start("draft", "draft_service", ["--model", str(tiny_pair.draft), "--quantize", "none"], free_port(), tmp_path)
    target = start("target", "target_service", target_args, target_port, tmp_path)
    processes = [draft, target]
    try:
        draft.wait_healthy(START_TIMEOUT_S)
        target.wait_healthy(START_TIMEOUT_S)
        coordinator = start(
            "coordinator", "coordinator",
            ["--draft", draft.address, "--target", target.address, "--tokenizer", str(tiny_pair.target), "--target-retry-timeout", "90"],
            free_port(), tmp_path,
        )
        processes.append(coordinator)
        coordinator.wait_healthy(START_TIMEOUT_S)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)

            # The target is killed after the first round and restarted on its address: the
            # coordinator retries, re-sends the committed tokens and finishes unchanged.
            stream = stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=200, num_speculative_tokens=4), timeout=120)
            chunks = [next(stream)]
            target.process.kill()
            target.process.wait()
            target = start("target-again", "target_service", target_args, target_port, tmp_path)
            processes.append(target)
            chunks += list(stream)
            assert [t for chunk in chunks for t in chunk.token_ids] == reference(PROMPT, 200)
            stats = chunks[-1].stats
            assert stats.target_retries >= 1 and stats.reprefills >= 1 and chunks[-1].finish_reason == "length"

            # A target that stays down: UNAVAILABLE before the client's deadline, never a hang
            # or a truncated success.
            target.process.kill()
            target.process.wait()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40), timeout=5)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert time.monotonic() - started < 5
            assert "target service" in failed.value.details()
    finally:
        for process in reversed(processes):
            process.stop()
