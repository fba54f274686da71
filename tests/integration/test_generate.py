"""Generate and GenerateStream through real gRPC servers (in process, port 0) on tiny models."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack, local_stack, slow_down

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "SELECT name, count(*) FROM",
    "Speculative decoding drafts tokens",
    "for i in range(10):\n",
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tiny_pair):
    async with inprocess_stack(tiny_pair) as running:
        yield running


async def generate(stack, **fields) -> pb.GenerateResponse:
    return await stack.stub.Generate(pb.GenerateRequest(**fields), timeout=60)


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_is_token_identical_to_target_alone_and_to_transformers(stack, reference, prompt):
    expected = reference(prompt, 40)
    target_only = await generate(stack, prompt=prompt, max_new_tokens=40, num_speculative_tokens=0)
    assert list(target_only.token_ids) == expected
    assert target_only.stats.proposed_tokens == 0
    for k in (1, 2, 3, 5, 8):
        speculative = await generate(stack, prompt=prompt, max_new_tokens=40, num_speculative_tokens=k)
        assert list(speculative.token_ids) == expected, f"K={k} diverged from the target's greedy output"
        assert speculative.text == target_only.text


async def test_speculation_accepts_tokens_and_reports_stats(stack):
    response = await generate(stack, prompt=PROMPTS[0], max_new_tokens=48, num_speculative_tokens=4)
    stats = response.stats
    assert stats.generated_tokens == len(response.token_ids)
    assert stats.accepted_tokens > 0, "the noisy-copy draft should agree with the target sometimes"
    assert stats.rounds < stats.generated_tokens, "speculation should commit more than one token per round"
    assert stats.recovered_tokens + stats.bonus_tokens == stats.rounds
    assert stats.accepted_tokens + stats.rounds >= stats.generated_tokens
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.proposed_tokens)
    assert stats.total_ms >= stats.time_to_first_token_ms > 0
    assert stats.prompt_tokens > 0 and stats.tokens_per_second > 0
    assert 0 < stats.target_compute_ms <= stats.target_ms and 0 < stats.draft_compute_ms <= stats.draft_ms
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert list(stats.accepted_per_position) == sorted(stats.accepted_per_position, reverse=True)
    assert len(stats.round_ms) == len(stats.round_overhead_ms) == stats.rounds
    assert all(0 < overhead < whole for overhead, whole in zip(stats.round_overhead_ms, stats.round_ms))
    assert response.finish_reason in ("length", "eos")


async def test_target_runs_each_token_once(stack):
    """The committed prefix is never recomputed: the target runs the prompt once, then only
    each round's new token and draft tokens."""
    before = stack.target_runner.processed_tokens_total
    response = await generate(stack, prompt=PROMPTS[1], max_new_tokens=30, num_speculative_tokens=3)
    processed = stack.target_runner.processed_tokens_total - before
    stats = response.stats
    assert processed == stats.prompt_tokens + stats.proposed_tokens + (stats.rounds - 1)


async def test_stream_matches_unary(stack):
    request = dict(prompt=PROMPTS[2], max_new_tokens=32, num_speculative_tokens=3)
    unary = await generate(stack, **request)
    chunks = [chunk async for chunk in stack.stub.GenerateStream(pb.GenerateRequest(**request), timeout=60)]
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert all(not c.finish_reason for c in chunks[:-1])
    assert chunks[-1].finish_reason == unary.finish_reason and chunks[-1].stats.rounds == unary.stats.rounds


async def test_k_zero_runs_several_steps_per_verify_call_and_a_seed_gives_the_same_output(stack, tiny_pair):
    """target_only_steps (4 by default): a K = 0 request's Verify call samples up to 4 tokens, each
    with the seed a call of its own would use, so sampled output is the same as with one step a
    call (and greedy output the target's, above); its tokens stream 4 a chunk after the first
    token, and the target still runs each token once."""
    requests = [
        dict(prompt=prompt, max_new_tokens=23, num_speculative_tokens=0, temperature=1.0, seed=seed)
        for seed, prompt in enumerate(PROMPTS)
    ]
    before = stack.target_runner.processed_tokens_total
    stepped = [await generate(stack, **request) for request in requests]
    processed = stack.target_runner.processed_tokens_total - before
    assert processed == sum(r.stats.prompt_tokens + len(r.token_ids) - 1 for r in stepped)
    chunks = [len(c.token_ids) async for c in stack.stub.GenerateStream(pb.GenerateRequest(**requests[0]), timeout=60)]
    assert sum(chunks) == len(stepped[0].token_ids) and chunks[0] == 1 and max(chunks) == 4, chunks
    async with inprocess_stack(tiny_pair, coordinator_overrides={"target_only_steps": 1}) as single:
        for request, response in zip(requests, stepped):
            alone = await single.stub.Generate(pb.GenerateRequest(**request), timeout=60)
            assert list(alone.token_ids) == list(response.token_ids), request
            assert alone.stats.rounds == response.stats.rounds == len(response.token_ids)
            # One timing a round either way: a call's steps share its time.
            for stats in (alone.stats, response.stats):
                assert len(stats.round_ms) == len(stats.round_overhead_ms) == len(stats.k_per_round) == stats.rounds
    calls = stepped[0].stats.round_ms
    assert calls[1] == calls[2] == calls[3] == calls[4] and calls[4] != calls[5], "steps 1-4 were one call"


@pytest.mark.parametrize("k", [1, 4, 8])
async def test_max_new_tokens_is_exact_even_when_a_round_accepts_several(stack, k):
    for max_new_tokens in (1, 2, 5, 7):
        response = await generate(stack, prompt=PROMPTS[4], max_new_tokens=max_new_tokens, num_speculative_tokens=k)
        assert len(response.token_ids) == max_new_tokens or response.finish_reason == "eos"


async def test_stop_string_ends_generation_before_it(stack, reference):
    full = await generate(stack, prompt=PROMPTS[3], max_new_tokens=40, num_speculative_tokens=4)
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    for streamed in (False, True):
        request = pb.GenerateRequest(
            prompt=PROMPTS[3], max_new_tokens=40, num_speculative_tokens=4, stop=[stop, "never-seen"]
        )
        if streamed:
            chunks = [c async for c in stack.stub.GenerateStream(request, timeout=60)]
            out_text = "".join(c.text for c in chunks)
            finish = chunks[-1].finish_reason
            assert all(stop not in "".join(c.text for c in chunks[: i + 1]) for i in range(len(chunks)))
        else:
            response = await stack.stub.Generate(request, timeout=60)
            out_text, finish = response.text, response.finish_reason
        assert finish == "stop"
        assert out_text == text[:first]


async def test_same_seed_same_output_and_sampling_varies(stack):
    request = dict(prompt=PROMPTS[0], max_new_tokens=24, temperature=0.9, top_p=0.95, num_speculative_tokens=3)
    first = await generate(stack, seed=42, **request)
    second = await generate(stack, seed=42, **request)
    assert list(first.token_ids) == list(second.token_ids)
    others = {tuple((await generate(stack, seed=seed, **request)).token_ids) for seed in range(5)}
    assert len(others) > 1


async def test_sessions_are_freed_after_each_request(stack):
    await generate(stack, prompt=PROMPTS[0], max_new_tokens=8, num_speculative_tokens=2)
    for _ in range(50):
        if len(stack.draft_runner.sessions) == 0 and len(stack.target_runner.sessions) == 0:
            break
        await asyncio.sleep(0.02)
    assert len(stack.draft_runner.sessions) == 0 and len(stack.target_runner.sessions) == 0


async def test_client_cancel_frees_sessions(stack):
    call = stack.stub.GenerateStream(
        pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=200, num_speculative_tokens=2)
    )
    await call.read()
    call.cancel()
    for _ in range(100):
        if len(stack.draft_runner.sessions) == 0 and len(stack.target_runner.sessions) == 0:
            break
        await asyncio.sleep(0.01)
    assert len(stack.draft_runner.sessions) == 0 and len(stack.target_runner.sessions) == 0


async def test_lost_sessions_are_reprefilled_without_changing_output(stack, reference):
    """A service that forgets a session mid-generation (eviction, restart) answers NOT_FOUND;
    the coordinator re-sends the sequence and the greedy output is unchanged."""
    prompt = PROMPTS[0]
    expected = reference(prompt, 40)
    tokens, reprefills = [], 0
    call = stack.stub.GenerateStream(
        pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=3), timeout=60
    )
    index = 0
    async for chunk in call:
        tokens.extend(chunk.token_ids)
        if index in (1, 3):  # forget both sessions twice during the generation
            for runner in (stack.draft_runner, stack.target_runner):
                for session_id in list(runner.sessions._sessions):
                    runner.end_session(session_id)
        if chunk.finish_reason:
            reprefills = chunk.stats.reprefills
        index += 1
    assert tokens == expected
    assert reprefills >= 2


# --- chat ------------------------------------------------------------------------------------


async def test_messages_go_through_the_chat_template(stack, tiny_pair):
    """A conversation is rendered with the tokenizer's own template, the assistant's turn
    opened, and generated exactly as that text sent as a prompt would be."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    chat = await generate(
        stack, messages=[pb.ChatMessage(**m) for m in messages], max_new_tokens=20, num_speculative_tokens=3
    )
    plain = await generate(stack, prompt_token_ids=ids, max_new_tokens=20, num_speculative_tokens=0)
    assert list(chat.token_ids) == list(plain.token_ids) and chat.stats.prompt_tokens == len(ids)
    streamed = [
        c
        async for c in stack.stub.GenerateStream(
            pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], max_new_tokens=20), timeout=60
        )
    ]
    assert [t for c in streamed for t in c.token_ids] == list(chat.token_ids)


async def test_a_tokenizer_without_a_chat_template_refuses_messages(word_pair):
    async with local_stack(word_pair) as words:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await words.stub.Generate(
                pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="w1")]), timeout=30
            )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in error.value.details()


# --- bad input -----------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": (dict(prompt=""), "prompt is empty"),
    "both prompt and ids": (dict(prompt="hi", prompt_token_ids=[1, 2]), "exactly one of prompt, prompt_token_ids and"),
    "both prompt and messages": (
        dict(prompt="hi", messages=[pb.ChatMessage(role="user", content="hi")]),
        "got prompt and messages",
    ),
    "unknown chat role": (
        dict(messages=[pb.ChatMessage(role="robot", content="hi")]),
        r"messages\[0\]\.role is 'robot'; use one of system, user, assistant",
    ),
    "token id beyond vocab": (dict(prompt_token_ids=[1, 320]), r"outside the vocabulary; ids must be in \[0, 320\)"),
    "negative token id": (dict(prompt_token_ids=[-1]), "outside the vocabulary"),
    "negative temperature": (dict(prompt="hi", temperature=-0.5), r"temperature must be 0 \(greedy\) or in"),
    "nan temperature": (dict(prompt="hi", temperature=float("nan")), r"temperature must be 0 \(greedy\) or in"),
    "top_p zero": (dict(prompt="hi", top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p above one": (dict(prompt="hi", top_p=1.5), r"top_p must be in \(0, 1\]"),
    "negative top_k": (dict(prompt="hi", top_k=-3), r"top_k must be in \[0, 2\^31\)"),
    "zero max_new_tokens": (dict(prompt="hi", max_new_tokens=0), r"max_new_tokens must be in \[1, 2048\]"),
    "huge max_new_tokens": (dict(prompt="hi", max_new_tokens=100_000), r"max_new_tokens must be in \[1, 2048\]"),
    "prompt longer than context": (dict(prompt_token_ids=[5] * 256), "the model's context is 256"),
    "K above maximum": (dict(prompt="hi", num_speculative_tokens=33), r"num_speculative_tokens must be in \[0, 32\]"),
    "negative K": (dict(prompt="hi", num_speculative_tokens=-1), r"num_speculative_tokens must be in \[0, 32\]"),
    "empty stop string": (dict(prompt="hi", stop=[""]), "stop strings must have 1 to 256 characters"),
    "too many stop strings": (dict(prompt="hi", stop=["x"] * 17), "at most 16 are accepted"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_bad_request_is_invalid_argument_and_service_keeps_serving(stack, case):
    fields, message = BAD_REQUESTS[case]
    for streamed in (False, True):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            if streamed:
                async for _ in stack.stub.GenerateStream(pb.GenerateRequest(**fields), timeout=30):
                    pass
            else:
                await stack.stub.Generate(pb.GenerateRequest(**fields), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() and re.search(message, error.value.details()), error.value.details()
    ok = await generate(stack, prompt="hi", max_new_tokens=2)
    assert len(ok.token_ids) >= 1


@pytest.mark.parametrize("k", [0, 3])
async def test_a_sampled_stop_commits_exactly_the_tokens_up_to_it(stack, tiny_pair, k):
    """Sampled, as greedy: the token ids returned at a stop string are the run's own tokens up
    to the one that completes the stop, nothing drafted past it (issue 17, item 5)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    request = dict(prompt=PROMPTS[3], max_new_tokens=40, num_speculative_tokens=k, temperature=0.9, seed=7)
    full = await generate(stack, **request)
    ids, text = list(full.token_ids), full.text
    assert len(text) > 12
    stop = text[8:11]
    needed = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n], skip_special_tokens=True))
    stopped = await generate(stack, stop=[stop], **request)
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == ids[:needed]
    assert stopped.text == text[: text.find(stop)]
    assert stopped.stats.generated_tokens == needed


@pytest.mark.parametrize("k", [0, 4])
async def test_sampled_eos_is_the_last_token_committed(stack, tiny_pair, k):
    """A round that accepts EOS mid-way commits nothing after it, sampled as greedy."""
    ended = 0
    # A flat distribution (temperature 2) reaches EOS in few runs: 4 of seeds 0-59 at K = 0 and
    # 5 at K = 4 (the seeds listed first), run here with 3 that do not; run together, so they
    # share passes. A seeded run's tokens are its own, whatever runs beside it; the bound below
    # leaves room for a CPU whose rounding moves a draw.
    seeds = (0, 19, 31, 44, 2, 3, 13, 25, 37, 1, 4, 5)
    responses = await asyncio.gather(
        *(
            generate(stack, prompt=PROMPTS[1], max_new_tokens=64, num_speculative_tokens=k, temperature=2.0, seed=seed)
            for seed in seeds
        )
    )
    for response in responses:
        ids = list(response.token_ids)
        if response.finish_reason == "eos":
            ended += 1
            assert ids[-1] == tiny_pair.eos_token_id and tiny_pair.eos_token_id not in ids[:-1]
            assert response.stats.generated_tokens == len(ids)
        else:
            assert tiny_pair.eos_token_id not in ids
    assert ended >= 3, f"only {ended} of {len(seeds)} sampled generations ended at EOS; the test needs more"


async def test_a_pipelined_rounds_wait_for_its_pre_drafts_is_model_work_not_overhead(tiny_pair):
    """round_overhead_ms is a round's time outside the model work the services report. A
    pipelined round's draft work is its pre-drafts' (draft_ms stays 0), and the part of it the
    round waited for after its verify once counted as the framework's: about 95% of every round
    with a draft 30 ms a pass."""
    overrides = {"pipeline": True}
    async with local_stack(
        tiny_pair, coordinator_overrides=overrides, prepare_runners=lambda d, t: slow_down(d, 0.03)
    ) as st:
        request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=30, num_speculative_tokens=3)
        stats = (await st.stub.Generate(request, timeout=120)).stats
    assert stats.branch_wait_ms > 0.5 * stats.total_ms, "the pre-drafts' wait should dominate here"
    assert sum(stats.round_overhead_ms) < 0.5 * sum(stats.round_ms)


async def test_a_round_cut_short_by_a_stop_string_counts_only_the_tokens_returned(stack):
    """accepted, recovered and bonus tokens are the output's (generated = their sum, with K > 0
    and no target-only steps); a stop string inside a round once had them count the round's
    accepted drafts and its next token all the same."""
    full = await generate(stack, prompt=PROMPTS[0], max_new_tokens=40, num_speculative_tokens=6)
    cut = 0
    for start in range(2, 20):
        response = await generate(
            stack, prompt=PROMPTS[0], max_new_tokens=40, num_speculative_tokens=6, stop=[full.text[start : start + 2]]
        )
        s = response.stats
        assert s.accepted_tokens + s.recovered_tokens + s.bonus_tokens == s.generated_tokens == len(response.token_ids)
        assert s.mean_accepted_length == pytest.approx(s.generated_tokens / s.rounds)
        cut += response.finish_reason == "stop"
    assert cut
