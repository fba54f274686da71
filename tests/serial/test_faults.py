"""Node faults with real processes (and a slow draft in process): the draft dies and comes
back, the target restarts or stays down, SIGTERM drains, a cancelling client frees both
sessions, a slow draft is skipped."""

from __future__ import annotations

import json
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, coordinator_pb2_grpc, draft_pb2_grpc, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.pool_helpers import streamed_tokens
from tests.stack import START_TIMEOUT_S, ProcessStack, inprocess_stack, slow_down

PROMPT = "The quick brown fox"


def test_draft_death_falls_back_to_target_only_and_speculation_resumes_when_it_returns(tiny_pair, reference, tmp_path):
    args = ["--pool-refresh", "0.3", "--draft-timeout", "5"]
    with ProcessStack(tiny_pair, tmp_path, args) as stack, stack.channel() as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=200, num_speculative_tokens=4)

        # The draft is killed after the first round; the generation goes on target-only.
        stream = stub.GenerateStream(request, timeout=60)
        chunks = [next(stream)]
        stack.kill("draft")
        chunks += list(stream)
        assert streamed_tokens(chunks) == reference(PROMPT, 200)
        stats = chunks[-1].stats
        assert stats.degraded and stats.draft_failures >= 1 and stats.fallback_rounds > 0
        assert stats.accepted_tokens > 0, "the first round(s) should have speculated"

        # With the breaker open, the next request does not wait on the dead draft at all.
        short = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40, num_speculative_tokens=4)
        degraded = stub.Generate(short, timeout=60)
        assert list(degraded.token_ids) == reference(PROMPT, 40)
        assert degraded.stats.degraded and degraded.stats.proposed_tokens == 0 and degraded.stats.draft_failures == 0

        # The draft comes back on its address: a health probe closes the breaker.
        stack.start("draft").wait_healthy(START_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while True:
            response = stub.Generate(short, timeout=60)
            assert list(response.token_ids) == reference(PROMPT, 40)
            if not response.stats.degraded:
                break
            assert time.monotonic() < deadline, "speculation never resumed after the draft came back"
            time.sleep(0.2)
        assert response.stats.accepted_tokens > 0 and response.stats.draft_failures == 0


def test_a_draft_restarted_without_trees_degrades_a_tree_request_and_the_pair_follows_it(
    tiny_pair, reference, tmp_path
):
    """A draft that comes back as another drafter (here prompt lookup, which refuses trees)
    answers a tree call with INVALID_ARGUMENT. The request finishes target-only with the same
    output rather than failing; the coordinator re-reads the draft's Info, so the next tree
    request is refused up front with a clear error, and chains go on."""
    # Target passes held to 100 ms (an emulated profile), so the request is still running when
    # the draft comes back: 120 rounds take over 12 s, and a tiny draft restarts in 2-5 s (at
    # 60 ms the margin was about 3 s, and one run in six here failed).
    profile = tmp_path / "slow-target.json"
    profile.write_text(
        json.dumps({"name": "a slow target", "source": "this test", "pass_ms": [[1, 100.0]], "context_ms_per_1k": 0})
    )
    with (
        ProcessStack(tiny_pair, tmp_path, ["--draft-timeout", "5"], ["--pass-cost-profile", str(profile)]) as stack,
        stack.channel() as channel,
    ):
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        tree = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=120, tree_widths=[2, 1])
        stream = stub.GenerateStream(tree, timeout=120)
        chunks = [next(stream)]
        stack.kill("draft")
        stack.args["draft"] = ["--model", str(tiny_pair.draft), "--drafter", "ngram"]
        stack.start("draft").wait_healthy(START_TIMEOUT_S)
        chunks += list(stream)
        assert streamed_tokens(chunks) == reference(PROMPT, 120)
        stats = chunks[-1].stats
        assert stats.draft_failures >= 1 and stats.fallback_rounds > 0
        # The request took the pair read after the draft rejected its tree: it asked once
        # (twice if that read took longer than the request waits for it:
        # Upstream.reread_pair), not every round until the breaker opened at its 3 failures.
        log = "".join(path.read_text() for path in stack.logs.glob("coordinator*.log"))
        assert 1 <= log.count("rejected an internal call") <= 2, log[-3000:]

        deadline = time.monotonic() + 10
        while True:  # the Info refresh runs beside the request
            try:
                stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=8, tree_widths=[2, 1]), timeout=60)
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
                assert "does not serve token trees" in refused.details()
                break
            assert time.monotonic() < deadline, "the coordinator never noticed the draft stopped serving trees"
            time.sleep(0.2)
        chain = stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40, num_speculative_tokens=3), timeout=60
        )
        assert list(chain.token_ids) == reference(PROMPT, 40) and chain.stats.draft_failures == 0


def test_target_restart_is_reprefilled_and_a_dead_target_is_unavailable_within_the_deadline(
    tiny_pair, reference, tmp_path
):
    with ProcessStack(tiny_pair, tmp_path, ["--connect-timeout", "90"]) as stack, stack.channel() as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        # The target is killed after the first round and restarted on its address: the
        # coordinator retries, re-sends the committed tokens and finishes unchanged.
        stream = stub.GenerateStream(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=200, num_speculative_tokens=4), timeout=120
        )
        chunks = [next(stream)]
        stack.kill("target")
        stack.start("target")
        chunks += list(stream)
        assert streamed_tokens(chunks) == reference(PROMPT, 200)
        stats = chunks[-1].stats
        assert stats.target_retries >= 1 and stats.reprefills >= 1 and chunks[-1].finish_reason == "length"

        # A target that stays down: UNAVAILABLE before the client's deadline, never a hang
        # or a truncated success.
        stack.kill("target")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert time.monotonic() - started < 5
        assert "target service" in failed.value.details()


def test_sigterm_turns_health_not_serving_first_and_drains_the_request_in_flight(tiny_pair, reference, tmp_path):
    with ProcessStack(tiny_pair, tmp_path, ["--shutdown-grace", "30"]) as stack:
        coordinator = stack.current["coordinator"]
        with stack.channel() as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            # K=1 and 230 tokens: a couple of hundred rounds, still running when SIGTERM arrives.
            stream = stub.GenerateStream(
                pb.GenerateRequest(prompt=PROMPT, max_new_tokens=230, num_speculative_tokens=1), timeout=120
            )
            chunks = [next(stream)]
            coordinator.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            while (
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                != health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                assert time.monotonic() < deadline, "health did not turn NOT_SERVING promptly after SIGTERM"
                time.sleep(0.02)
            chunks += list(stream)
            assert streamed_tokens(chunks) == reference(PROMPT, 230)
            assert chunks[-1].finish_reason == "length"
        assert coordinator.process.wait(timeout=30) == 0
        log = coordinator.log.read_text()
        assert log.index("shutting down") < log.index("generated 230 tokens"), (
            "the request should have been in flight at SIGTERM"
        )


async def test_a_draft_slower_than_its_deadline_is_skipped_not_waited_for(tiny_pair, reference):
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, coordinator_overrides={"draft_timeout_s": 0.2}
    ) as stack:
        slow_down(stack.draft_runner, 0.5)
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40, num_speculative_tokens=4), timeout=60
        )
        assert list(response.token_ids) == reference(PROMPT, 40)
        s = response.stats
        assert s.degraded and s.draft_failures >= 1 and s.proposed_tokens == 0
        # Waiting for the draft would take at least 0.5 s per draft step; skipping costs at most
        # one deadline per failed call (and nothing once the breaker is open).
        assert s.total_ms < 1000 * (0.2 * s.draft_failures + 3.0)


def test_a_client_that_cancels_frees_both_sessions_within_a_second(tiny_pair, tmp_path):
    with (
        ProcessStack(tiny_pair, tmp_path, []) as stack,
        stack.channel() as channel,
        stack.channel("draft") as d,
        stack.channel("target") as t,
    ):
        infos = {"draft": draft_pb2_grpc.DraftStub(d).Info, "target": target_pb2_grpc.TargetStub(t).Info}

        def open_sessions() -> dict[str, int]:
            return {name: info(common_pb2.InfoRequest(), timeout=5).open_sessions for name, info in infos.items()}

        stream = coordinator_pb2_grpc.CoordinatorStub(channel).GenerateStream(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=230, num_speculative_tokens=1), timeout=60
        )
        next(stream)
        assert open_sessions() == {"draft": 1, "target": 1}
        stream.cancel()
        cancelled = time.monotonic()
        while (sessions := open_sessions()) != {"draft": 0, "target": 0}:
            assert time.monotonic() - cancelled < 1.0, (
                f"sessions still open a second after the client cancelled: {sessions}"
            )
            time.sleep(0.02)
