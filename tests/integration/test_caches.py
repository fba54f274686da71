"""Issue 37 through real gRPC servers: with both services keeping prompt blocks and the suffix
drafter keeping earlier outputs, greedy output is still the target's own while sessions start
from cached blocks and copy earlier requests' text; and a request's cache_salt, or its caller's
bearer token, keeps both caches apart."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from specdec.config.services import ClientSecurity, ServerSecurity
from specdec.rpc.security import aio_channel, load_client_security
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc
from tests.stack import inprocess_stack

CACHES = {"prefix_cache_bytes": 1 << 24, "prefix_block_tokens": 4}
SUFFIX_DRAFT = {"drafter": "suffix", "quantize": "none", "ngram_min": 2, **CACHES}
PROMPTS = ["def add(a, b):", "The quick brown fox"]


async def settled(stack) -> None:
    """Waits until the coordinator's EndSession calls (sent as a request finishes, not
    awaited) have reached both services: only then are a request's blocks and output kept."""
    for _ in range(200):
        if not len(stack.target_runner.sessions) and not len(stack.draft_runner.sessions):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("sessions were not ended")


async def test_cache_hits_and_earlier_outputs_leave_greedy_output_the_targets(tiny_pair, reference):
    async with inprocess_stack(tiny_pair, draft_overrides=SUFFIX_DRAFT, target_overrides=CACHES) as stack:
        copied = []
        for attempt in range(2):  # the second time, every prompt's blocks and output are cached
            for prompt in PROMPTS:
                response = await stack.stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=32), timeout=60)
                assert list(response.token_ids) == reference(prompt, 32), f"diverged on {prompt!r} ({attempt})"
                copied.append(response.stats.copied_rounds)
                await settled(stack)
        # A second turn: the conversation so far, then more; its first blocks are the first turn's.
        first = await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=32), timeout=60)
        await settled(stack)
        turn = PROMPTS[0] + first.text + "\n# again\n" + PROMPTS[0]
        second = await stack.stub.Generate(pb.GenerateRequest(prompt=turn, max_new_tokens=32), timeout=60)
        assert list(second.token_ids) == reference(turn, 32)
        for runner in (stack.target_runner, stack.draft_runner):
            prefix = runner.sessions.prefix
            assert prefix.hits >= 3 and prefix.tokens_saved > 0, (prefix.hits, prefix.tokens_saved)
        assert sum(copied[len(PROMPTS) :]) > sum(copied[: len(PROMPTS)]), "repeats never copied the earlier output"


async def test_the_suffix_store_learns_only_what_requests_output(tiny_pair, reference):
    """A pipelined request's last call may be a pre-draft, which keeps the round's drafts
    before their verify; a request that then ends in that round (here on a stop string) once
    taught the store drafts its verify rejected. It learns no more than the coordinator says
    the session holds of the output (EndSessionRequest.committed_tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    overrides = {"pipeline": True, "catch_up": False}  # every round after the first pre-drafts
    async with inprocess_stack(tiny_pair, draft_overrides=SUFFIX_DRAFT, coordinator_overrides=overrides) as stack:
        store, predrafts = stack.draft_runner.lookup.store, 0
        for prompt in PROMPTS:
            output = reference(prompt, 40)
            for cut in (7, 13, 19, 25):
                request = pb.GenerateRequest(
                    prompt=prompt, max_new_tokens=40, num_speculative_tokens=4, cache_salt=f"{prompt}{cut}"
                )
                request.stop.append(tokenizer.decode(output[cut : cut + 2]))
                response = await stack.stub.Generate(request, timeout=60)
                predrafts += response.stats.predrafts
                await settled(stack)
                learned = list(store._sequences.values())[-1][1].tolist()
                truth = tokenizer(prompt).input_ids + output
                assert learned == truth[: len(learned)], f"{prompt!r} cut at {cut}: learned {learned}"
        assert predrafts > 0


async def test_a_cache_salt_keeps_prompt_blocks_and_outputs_apart(tiny_pair):
    async with inprocess_stack(tiny_pair, draft_overrides=SUFFIX_DRAFT, target_overrides=CACHES) as stack:
        prefix = stack.target_runner.sessions.prefix

        async def generate(salt: str) -> None:
            await stack.stub.Generate(
                pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=8, cache_salt=salt), timeout=60
            )
            await settled(stack)

        await generate("alice")
        await generate("bob")  # another namespace: nothing of alice's
        assert prefix.hits == 0
        await generate("alice")
        assert prefix.hits == 1
        await generate("")  # the shared namespace is a namespace of its own too
        assert prefix.hits == 1
        namespaces = {namespace for namespace, _ in stack.draft_runner.lookup.store._sequences.values()}
        assert len(namespaces) == 3 and "" in namespaces  # the suffix store keeps them apart as well

        with pytest.raises(Exception, match="cache_salt has 300 characters"):
            await generate("x" * 300)


async def test_each_bearer_token_is_a_namespace(tiny_pair, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("token-alice\ntoken-bob\n")
    callers = {}
    for name in ("alice", "bob"):
        path = tmp_path / name
        path.write_text(f"token-{name}\n")
        callers[name] = ClientSecurity(auth_token_file=str(path))
    async with inprocess_stack(
        tiny_pair,
        draft_overrides=SUFFIX_DRAFT,
        target_overrides=CACHES,
        coordinator_overrides={"security": ServerSecurity(auth_token_file=str(tokens))},
        client_security=callers["alice"],
    ) as stack:
        prefix = stack.target_runner.sessions.prefix
        request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=8)
        await stack.stub.Generate(request, timeout=60)
        await settled(stack)
        address = f"127.0.0.1:{stack.coordinator.port}"
        async with aio_channel(address, [], load_client_security(callers["bob"])) as channel:
            await coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=60)
        await settled(stack)
        assert prefix.hits == 0, "bob's session started from alice's blocks"
        await stack.stub.Generate(request, timeout=60)
        assert prefix.hits == 1
