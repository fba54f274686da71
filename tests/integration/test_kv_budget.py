"""A target with a KV budget too small for its concurrent generations: the coordinator admits
what fits and queues the rest (coordinator.pools, `Pool.admit`); where it does not know the
budget, the target evicts sessions in the middle of them, the coordinator re-prefills, and
every greedy output is still the target's own."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from specdec.engine.modeling import load_causal_lm
from specdec.engine.runner import kv_bytes_per_token
from specdec.errors import ResourceExhausted
from specdec.v1 import coordinator_pb2 as pb
from target_service.servicer import TargetServicer
from tests.stack import inprocess_stack

PROMPTS = ["def add(a, b):", "The quick brown fox", "SELECT name, count(*) FROM"]


async def generate_all(stack) -> list[pb.GenerateResponse]:
    """Every prompt at once, greedy, 40 tokens at K = 4."""
    return await asyncio.gather(
        *(
            stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=4), timeout=120
            )
            for prompt in PROMPTS
        )
    )


async def generate_once_there_is_room(stack, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """Generate, asked again while the target is refused for want of room: a finished request's
    session holds its place until the target has answered its end (`Upstream.end_and_release`),
    which a 1 ms --queue-timeout does not wait for."""
    for _ in range(100):
        try:
            return await stack.stub.Generate(request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("no room on the target 5 s after every other request had finished")


def budget_unsaid(_draft_runner, target_runner) -> None:
    """The target keeps its KV budget to itself, as one of an older build did: the coordinator
    cannot admit by it, so the target's own eviction is all that holds it."""
    describe = target_runner.describe
    target_runner.describe = lambda: dataclasses.replace(describe(), max_kv_cache_bytes=0)


async def test_evictions_mid_generation_leave_greedy_output_unchanged(tiny_pair, reference):
    per_token = kv_bytes_per_token(load_causal_lm(str(tiny_pair.target), "float32", "cpu").model)
    budget = 80 * per_token  # one generation (prompt + 40 tokens + K) fits, three at once do not
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        target_overrides={"max_kv_bytes": budget},
        prepare_runners=budget_unsaid,
    ) as stack:
        responses = await generate_all(stack)
        for prompt, response in zip(PROMPTS, responses):
            assert list(response.token_ids) == reference(prompt), f"eviction changed the output for {prompt!r}"
        assert stack.target_runner.sessions.max_kv_bytes == budget
        assert stack.target_runner.sessions.evicted > 0 and sum(r.stats.reprefills for r in responses) > 0


async def test_a_full_target_queues_requests_instead_of_evicting_their_sessions(tiny_pair, reference):
    """The same budget, reported in Info: the coordinator places a session only where its
    prompt and max_new_tokens fit beside the others' (Replica.room), so the three requests
    run one after another, none evicted or re-prefilled, each output the target's own."""
    per_token = kv_bytes_per_token(load_causal_lm(str(tiny_pair.target), "float32", "cpu").model)
    budget = 80 * per_token
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, target_overrides={"max_kv_bytes": budget}
    ) as stack:
        responses = await generate_all(stack)
        for prompt, response in zip(PROMPTS, responses):
            assert list(response.token_ids) == reference(prompt), f"queueing changed the output for {prompt!r}"
        assert stack.target_runner.describe().max_kv_cache_bytes == budget
        assert stack.target_runner.sessions.evicted == 0 and sum(r.stats.reprefills for r in responses) == 0
        queued = sorted(r.stats.queued_ms for r in responses)
        assert queued[0] == 0 and queued[1] > 0 and queued[2] > queued[1]  # one at a time, in turn
        for response in responses:  # the wait is part of the time to the first token
            assert response.stats.time_to_first_token_ms >= response.stats.queued_ms

        # A prompt that cannot fit even alone runs alone: RESOURCE_EXHAUSTED from the target,
        # with the numbers, and the service goes on serving.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.stub.Generate(
                pb.GenerateRequest(prompt_token_ids=list(range(1, 120)), max_new_tokens=4), timeout=60
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-kv-bytes" in refused.value.details() and f"is {budget} bytes" in refused.value.details()
        response = await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=40), timeout=60)
        assert list(response.token_ids) == reference(PROMPTS[0])


async def test_a_session_holds_its_place_until_the_target_has_ended_it(tiny_pair, reference, monkeypatch):
    """A target with room for one session, whose EndSession answers late (a loaded host): the
    finished request's place is freed once the end is answered, not as it is sent, so the next
    request waits for it rather than being refused RESOURCE_EXHAUSTED by the target."""
    end_session = TargetServicer.EndSession

    async def late_end(self, request, context):
        await asyncio.sleep(0.5)
        return await end_session(self, request, context)

    monkeypatch.setattr(TargetServicer, "EndSession", late_end)
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, target_overrides={"max_sessions": 1}
    ) as stack:
        for prompt in PROMPTS:
            response = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=8, num_speculative_tokens=2), timeout=60
            )
            assert list(response.token_ids) == reference(prompt)[:8]
        assert response.stats.queued_ms >= 200  # the last waited for the previous one's end


async def test_waiting_requests_beyond_the_bound_or_the_timeout_are_refused_clearly(tiny_pair, reference):
    """max_waiting_requests (fixed) and --queue-timeout: one request holds the only room, one waits,
    a third is refused at once; a wait longer than the timeout is refused; none of it stops the
    coordinator serving."""
    per_token = kv_bytes_per_token(load_causal_lm(str(tiny_pair.target), "float32", "cpu").model)
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        target_overrides={"max_kv_bytes": 80 * per_token},
        coordinator_overrides={"max_waiting_requests": 1, "queue_timeout_s": 30.0},
    ) as stack:

        def generate(prompt: str, tokens: int = 40):
            return stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=tokens, num_speculative_tokens=4), timeout=120
            )

        results = await asyncio.gather(*(generate(prompt) for prompt in PROMPTS), return_exceptions=True)
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests already wait (the most that may)" in refused[0].details()
        for prompt, result in zip(PROMPTS, results):
            if not isinstance(result, grpc.aio.AioRpcError):
                assert list(result.token_ids) == reference(prompt)
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        target_overrides={"max_kv_bytes": 80 * per_token},
        coordinator_overrides={"queue_timeout_s": 0.001},
    ) as stack:
        results = await asyncio.gather(
            *(
                stack.stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=40), timeout=60)
                for prompt in PROMPTS[:2]
            ),
            return_exceptions=True,
        )
        late = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(late) == 1 and late[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(--queue-timeout) for room on the target pool" in late[0].details()
        for prompt in PROMPTS[:2]:
            response = await generate_once_there_is_room(stack, pb.GenerateRequest(prompt=prompt, max_new_tokens=40))
            assert list(response.token_ids) == reference(prompt)


async def test_a_prompt_too_long_for_the_draft_runs_target_only_and_other_requests_keep_speculating(
    tiny_pair, reference
):
    """The draft's KV budget is its own: a request it cannot hold (RESOURCE_EXHAUSTED from the
    draft) goes on target-only with the target's output instead of failing, and the breaker
    the other requests share stays closed."""
    per_token = kv_bytes_per_token(load_causal_lm(str(tiny_pair.draft), "float32", "cpu").model)
    budget = 30 * per_token  # the short prompt and its drafts fit; the long one does not
    long_prompt = " ".join(PROMPTS * 4)
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none", "max_kv_bytes": budget},
        coordinator_overrides={"breaker_failures": 1},
    ) as stack:
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=long_prompt, max_new_tokens=30, num_speculative_tokens=3), timeout=120
        )
        assert list(response.token_ids) == reference(long_prompt, 30)
        # Refused, then asked again after 4, 8 and 16 target-only rounds (DraftRefusals), refused
        # each time, and never a draft: the context only grows.
        stats = response.stats
        assert stats.rounds == 30 and stats.draft_failures == 4 and stats.proposed_tokens == 0
        assert stats.fallback_rounds >= stats.rounds - 1
        short = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=10, num_speculative_tokens=3), timeout=120
        )
        assert list(short.token_ids) == reference(PROMPTS[1], 10)
        assert not short.stats.degraded and short.stats.accepted_tokens > 0


def refusing_twice(refusals: list[str]):
    """prepare_runners: the draft refuses the first two sessions it is asked to open, as if
    another request held its only slot."""

    def prepare(draft_runner, _target_runner) -> None:
        open_session = draft_runner.sessions.open

        def open_or_refuse(session_id: str, keep_tokens: int, namespace: str = ""):
            if len(refusals) < 2:
                refusals.append(session_id)
                raise ResourceExhausted("1 sessions are open, the configured maximum is 1; retry later")
            return open_session(session_id, keep_tokens, namespace)

        draft_runner.sessions.open = open_or_refuse

    return prepare


async def generate_refused_twice(tiny_pair, reference, **coordinator_overrides) -> tuple[list[str], pb.GenerationStats]:
    """One greedy request against a draft that refuses its first two sessions; the output must
    be the target's own. Returns (the refused session ids, the request's stats)."""
    refusals: list[str] = []
    prompt = PROMPTS[0]
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        coordinator_overrides={"breaker_failures": 1, **coordinator_overrides},
        prepare_runners=refusing_twice(refusals),
    ) as stack:
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=3), timeout=120
        )
    assert list(response.token_ids) == reference(prompt, 40)
    return refusals, response.stats


async def test_a_request_the_draft_had_no_session_for_speculates_once_one_frees(tiny_pair, reference):
    """A draft whose sessions are all taken refuses a request (RESOURCE_EXHAUSTED); the request
    runs target-only rounds and asks again after 4, then 8: once a slot is free, it speculates
    for the rest of the request, with the target's greedy output throughout."""
    refusals, stats = await generate_refused_twice(tiny_pair, reference)
    assert len(refusals) == 2 and stats.draft_failures == 2 and stats.degraded  # degraded: it had fallback rounds
    # Rounds 0-11 run target-only (refused at 0 and 4); from round 12 on, the draft drafts.
    assert list(stats.k_per_round)[:12] == [0] * 12 and stats.proposed_tokens > 0 and stats.accepted_tokens > 0
    assert all(k > 0 for k in list(stats.k_per_round)[12:-1])


async def test_a_refused_catch_up_pre_draft_backs_off_like_a_refused_draft_call(tiny_pair, reference):
    """Pipelined, the first round's draft call is its catch-up pre-draft: a refusal there
    starts the same back-off (target-only rounds 1-4, then a regular call, refused, then 8
    more) rather than a refused call every round."""
    refusals, stats = await generate_refused_twice(tiny_pair, reference, pipeline=True)
    assert len(refusals) == 2 and stats.draft_failures == 1  # the pre-draft's refusal is not a failed draft call
    assert list(stats.k_per_round)[:13] == [0] * 13 and stats.proposed_tokens > 0
