"""End to end with each service in its own process, as `python -m ...` on free loopback ports."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.rpc.ports import free_port
from specdec.tools.launch import ServiceProcess, pinned_to, spawn
from specdec.tools.testing import build_model, word_tokenizer
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


# As deployed on separate nodes, emulated on this machine: draft and target each pinned to a
# core of their own (the same one on a 1-core machine), the coordinator pre-drafting and hedging.
CORES = sorted(os.sched_getaffinity(0))
PINS = {"draft": (CORES[0],), "target": (CORES[-1],), "coordinator": (CORES[-1],)}


def start(name: str, module: str, *args: str, logs: Path) -> ServiceProcess:
    log = logs / f"{name}.log"
    return spawn(name, module, list(args), free_port(), log, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT, cpus=PINS[name])


@pytest.fixture(scope="module")
def processes(tiny_pair, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    draft = start("draft", "draft_service", "--model", str(tiny_pair.draft), logs=logs)
    target = start("target", "target_service", "--model", str(tiny_pair.target), logs=logs)
    coordinator = start(
        "coordinator",
        "coordinator",
        "--draft",
        draft.address,
        "--target",
        target.address,
        "--tokenizer",
        str(tiny_pair.target),
        "--draft-timeout",
        "5",
        "--pipeline",
        "on",
        "--hedges",
        "2",
        "--bonus-guesses",
        "1",
        logs=logs,
    )
    services = {"draft": draft, "target": target, "coordinator": coordinator}
    try:
        for service in services.values():
            service.wait_healthy(START_TIMEOUT_S)
        yield services
    finally:
        for service in services.values():
            service.stop()


def test_generate_and_stream_across_processes(processes, tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    prompt = "def add(a, b):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
    with grpc.insecure_channel(processes["coordinator"].address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response = stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=32, num_speculative_tokens=4), timeout=60
        )
        assert list(response.token_ids) == expected
        assert response.stats.accepted_tokens > 0 and response.stats.rounds < len(expected)
        chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=32), timeout=60))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert "".join(c.text for c in chunks) == response.text
        assert chunks[-1].finish_reason == response.finish_reason and chunks[-1].stats.generated_tokens == len(expected)


def test_each_service_runs_on_the_cores_it_was_pinned_to(processes):
    for name, service in processes.items():
        assert os.sched_getaffinity(service.process.pid) == set(PINS[name]), name
        threads = Path(f"/proc/{service.process.pid}/task")
        for task in threads.iterdir():  # torch's and gRPC's threads inherit it
            try:
                assert os.sched_getaffinity(int(task.name)) == set(PINS[name]), (name, task.name)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile


def test_reflection_lists_services(processes):
    expected = {
        "draft": "specdec.v1.Draft",
        "target": "specdec.v1.Target",
        "coordinator": "specdec.v1.Coordinator",
    }
    for name, service in expected.items():
        with grpc.insecure_channel(processes[name].address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            names = {s.name for r in responses for s in r.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names


def test_an_unreachable_draft_degrades_and_an_unreachable_target_is_unavailable(processes):
    """Runs last among the tests on `processes`: it stops the draft, then the target. The draft
    is an accelerator: without it requests still succeed, target-only and marked degraded. The
    target is needed: without it the client gets UNAVAILABLE naming it, within its deadline."""
    processes["draft"].stop()
    with grpc.insecure_channel(processes["coordinator"].address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        started = time.monotonic()
        response = stub.Generate(
            pb.GenerateRequest(prompt="hello", max_new_tokens=8, num_speculative_tokens=2), timeout=30
        )
        assert time.monotonic() - started < 10, "an unreachable draft must be given up on fast, not waited for"
        # Its calls fail, or a pool refresh has found it gone and rounds skip it without calling.
        assert response.stats.degraded and response.stats.fallback_rounds > 0 and len(response.token_ids) == 8
        processes["target"].stop()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(pb.GenerateRequest(prompt="hello", max_new_tokens=4, num_speculative_tokens=0), timeout=5)
        assert time.monotonic() - started < 5
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert processes["target"].address in error.value.details()


def test_coordinator_refuses_pair_with_different_tokenizers(tiny_pair, tmp_path):
    other = tmp_path / "other-draft"
    build_model(other, word_tokenizer(16), seed=3, logit_scale=1.0, eos_token_id=None)
    draft = start("draft", "draft_service", "--model", str(other), logs=tmp_path)
    target = start("target", "target_service", "--model", str(tiny_pair.target), logs=tmp_path)
    try:
        draft.wait_healthy(START_TIMEOUT_S)
        target.wait_healthy(START_TIMEOUT_S)
        coordinator = start(
            "coordinator",
            "coordinator",
            "--draft",
            draft.address,
            "--target",
            target.address,
            "--tokenizer",
            str(tiny_pair.target),
            logs=tmp_path,
        )
        assert coordinator.process.wait(timeout=60) != 0
        output = coordinator.log.read_text()
        assert "draft and target tokenizers differ" in output
        assert str(other) in output and str(tiny_pair.target) in output
    finally:
        draft.stop()
        target.stop()


def test_pinning_says_taskset_and_refuses_a_core_this_process_may_not_use():
    assert pinned_to(()) == []
    assert pinned_to(CORES[:1]) == ["taskset", "--cpu-list", str(CORES[0])]
    with pytest.raises(ValueError, match="may run on"):
        pinned_to((max(CORES) + 1000,))
