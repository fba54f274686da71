"""Sequential, pipelined, hedged and adaptive-K coordinators through real gRPC servers: greedy
output is the target's own in every mode, a stale pre-draft or hedge is cancelled, cut short on
the draft service and never reaches the output, and no branch session outlives its request.
(Sampled exactness per mode is in test_distribution.)"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from coordinator import server as coordinator_server
from coordinator.overlap import HEDGE_COUNTS
from specdec.engine.costs import PassCosts
from specdec.errors import InvalidArgument
from specdec.rpc import wire
from specdec.sampling.probs import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack, slow_down

MODES = {
    "sequential": {},
    "pipelined": {"pipeline": True},
    "pipelined_waiting": {"pipeline": True, "catch_up": False},  # a miss waits for fresh drafts
    "adaptive": {},
    "pipelined_adaptive": {"pipeline": True},
    "hedged": {"hedges": 2},
    "pipelined_hedged_adaptive": {"pipeline": True, "hedges": 3},
    # The bonus token guessed three ways: the pre-draft's argmax and forks for two runner-ups.
    "pipelined_bonus_guesses": {"pipeline": True, "hedges": 2, "bonus_guesses": 3, "catch_up": False},
}
# The modes whose runners are given costs under which the K chooser speculates; the others
# have none (the tiny pair is not calibrated here), so their requests run at the fallback K.
CHOOSER_MODES = {"adaptive", "pipelined_adaptive", "pipelined_hedged_adaptive"}
MAX_HEDGES = max(HEDGE_COUNTS)  # the most the coordinator chooses
PROMPTS = ["def add(a, b):", "The quick brown fox", "SELECT name, count(*) FROM"]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=sorted(MODES))
async def stack(request, tiny_pair):
    def chooser_costs(draft_runner, target_runner) -> None:
        # Figures under which the K chooser speculates (a cheap draft, a flat verify).
        if request.param in CHOOSER_MODES:
            draft_runner.pass_costs = PassCosts((1.0,) * 9, context_tokens=128)
            target_runner.pass_costs = PassCosts((40.0,) * 9, context_tokens=128)

    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        # The chooser costs rounds from the figures set here, not from the tiny pair's live passes.
        coordinator_overrides={**MODES[request.param], "live_costs": False},
        prepare_runners=chooser_costs,
    ) as running:
        running.mode = request.param
        yield running


async def test_greedy_output_is_the_targets_in_every_mode(stack, reference):
    totals = {"hits": 0, "cancelled": 0, "hedge_hits": 0, "catch_ups": 0, "bonus_guess_hits": 0}
    for prompt in PROMPTS:
        expected = reference(prompt)
        for k in (1, 3, 5, None):  # None: the coordinator's default, or adaptive K
            response = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=k), timeout=60
            )
            assert list(response.token_ids) == expected, f"{stack.mode}, K={k}: diverged on {prompt!r}"
            s = response.stats
            assert s.pipelined == ("pipeline" in MODES[stack.mode])
            assert sum(s.k_per_round) == s.proposed_tokens and len(s.k_per_round) == s.rounds
            assert s.predrafts == s.predraft_hits + s.predraft_misses + s.predraft_cancelled
            assert s.branch_failures == 0, f"{stack.mode}: the draft failed a branch"
            totals["hits"] += s.predraft_hits
            assert s.bonus_guess_hits <= s.predraft_hits
            totals["bonus_guess_hits"] += s.bonus_guess_hits
            totals["cancelled"] += s.predraft_cancelled
            assert s.hedge_hits <= min(s.hedges, s.recovered_tokens) and s.hedged_tokens <= s.hedge_hits * 16
            totals["hedge_hits"] += s.hedge_hits
            # A catch-up round is a target-only step (K = 0) while the draft drafts the next.
            assert s.catch_up_rounds <= list(s.k_per_round).count(0)
            totals["catch_ups"] += s.catch_up_rounds
            if "adaptive" in stack.mode and k is None:
                assert len(set(s.k_per_round[:-1])) >= 1
    pipelined, hedged = "pipeline" in MODES[stack.mode], "hedges" in MODES[stack.mode]
    assert (totals["hits"] > 0 and totals["cancelled"] > 0) == pipelined, totals
    assert (totals["hedge_hits"] > 0) == hedged, totals
    assert (totals["bonus_guess_hits"] > 0) == ("bonus_guesses" in MODES[stack.mode]), totals
    assert (totals["catch_ups"] > 0) == (pipelined and MODES[stack.mode].get("catch_up", True)), totals
    await _until_no_sessions(stack.draft_runner)


async def _until_no_sessions(runner, timeout_s: float = 10.0) -> None:
    """Sessions are freed right after each response, without the client waiting: poll."""
    deadline = time.monotonic() + timeout_s
    while len(runner.sessions) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(runner.sessions) == 0, f"{len(runner.sessions)} draft sessions outlived their requests"


@pytest.mark.parametrize("whole", [False, True], ids=["each branch", "the whole call"])
async def test_branches_the_draft_fails_are_counted_and_the_output_is_the_targets(tiny_pair, reference, whole):
    """A draft that answers every ProposeBranches branch with an error (as an EAGLE head's
    batches did before its sessions shared passes), or fails the whole call: the rounds go on
    without them, and the request's stats count them."""
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none", "batch_window_ms": 0},  # ProposeBranches calls propose_batch
        coordinator_overrides={"pipeline": True, "hedges": 2},
    ) as stack:

        def fail(calls, *_):
            if whole:
                raise InvalidArgument("no branches here")
            return [InvalidArgument("no branch here")] * len(calls)

        stack.draft_runner.propose_batch = fail
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=24, num_speculative_tokens=3), timeout=60
        )
        assert list(response.token_ids) == reference(PROMPTS[0], 24)
        assert response.stats.branch_failures > 0 and response.stats.predraft_hits == response.stats.hedge_hits == 0


@pytest.mark.parametrize("overrides", [{"pipeline": True}, {"hedges": 3}], ids=["predraft", "hedges"])
async def test_stale_predraft_is_cancelled_on_the_draft_and_never_used(tiny_pair, reference, overrides):
    """A slow draft keeps each pre-draft (or hedge) in flight when its round ends otherwise:
    the coordinator cancels the RPC, the draft service stops drafting at its next step, no
    branch session is left behind, and the output is still the target's greedy output."""
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, coordinator_overrides=overrides
    ) as stack:
        runner = stack.draft_runner
        slow_down(runner, 0.03)
        prompt = PROMPTS[1]
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=6), timeout=60
        )
        assert list(response.token_ids) == reference(prompt)
        s = response.stats
        if "pipeline" in overrides:
            assert s.predraft_cancelled > 0
        else:
            assert s.hedges > s.hedge_hits > 0, (s.hedges, s.hedge_hits)
        assert runner.stopped_proposals > 0, "cancelled pre-drafts should stop early on the draft service"
        await _until_no_sessions(runner)


async def test_a_call_older_than_one_served_is_refused_and_changes_nothing(tiny_pair):
    async with inprocess_stack(tiny_pair, draft_overrides={"quantize": "none"}) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
            draft = draft_pb2_grpc.DraftStub(channel)
            sampling = wire.params_to_pb(SamplingParams())  # greedy
            first = await draft.Propose(
                draft_pb2.ProposeRequest(
                    session_id="e", keep_tokens=0, new_tokens=[5, 6, 7], num_tokens=2, sampling=sampling, epoch=5
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await draft.Propose(
                    draft_pb2.ProposeRequest(
                        session_id="e", keep_tokens=3, new_tokens=[9], num_tokens=2, sampling=sampling, epoch=4
                    )
                )
            assert stale.value.code() == grpc.StatusCode.ABORTED and "superseded" in stale.value.details()
            assert stack.draft_runner.sessions.open("e", 1).tokens == [5, 6, 7, *first.token_ids]
            later = await draft.Propose(
                draft_pb2.ProposeRequest(
                    session_id="e", keep_tokens=5, new_tokens=[], num_tokens=1, sampling=sampling, epoch=6
                )
            )
            assert later.sequence_length == 6


async def test_propose_branches_steps_forks_with_their_parent_and_fails_each_branch_alone(tiny_pair):
    """The draft's ProposeBranches over gRPC: the pre-draft and its hedges share passes, a
    branch that cannot run carries its own status while the others answer, a call ends the
    sessions it is asked to end first, and a call with no branches (or too many), or asked to
    end one of its own sessions (or too many), is INVALID_ARGUMENT."""
    async with inprocess_stack(tiny_pair, draft_overrides={"quantize": "none"}) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
            draft = draft_pb2_grpc.DraftStub(channel)
            sampling = wire.params_to_pb(SamplingParams())
            first = await draft.Propose(
                draft_pb2.ProposeRequest(
                    session_id="s", new_tokens=[5, 6, 7, 8], num_tokens=3, sampling=sampling, epoch=1
                )
            )
            held = 4 + len(first.token_ids)
            reply = await draft.ProposeBranches(
                draft_pb2.ProposeBranchesRequest(
                    branches=[
                        draft_pb2.ProposeRequest(
                            session_id="h0",
                            fork_from="s",
                            keep_tokens=4,
                            new_tokens=[9],
                            num_tokens=3,
                            sampling=sampling,
                            epoch=2,
                        ),
                        draft_pb2.ProposeRequest(
                            session_id="h1",
                            fork_from="gone",
                            keep_tokens=4,
                            new_tokens=[9],
                            num_tokens=3,
                            sampling=sampling,
                            epoch=3,
                        ),
                        draft_pb2.ProposeRequest(
                            session_id="s", keep_tokens=held, num_tokens=4, sampling=sampling, epoch=4
                        ),
                    ]
                )
            )
            codes = [r.error_code for r in reply.results]
            assert codes == [0, grpc.StatusCode.NOT_FOUND.value[0], 0], [
                (r.error_code, r.error_message) for r in reply.results
            ]
            assert "gone" in reply.results[1].error_message
            assert len(reply.results[0].proposal.token_ids) == 3 and len(reply.results[2].proposal.token_ids) == 4
            assert reply.results[2].proposal.sequence_length == held + 4
            runner = stack.draft_runner
            assert runner.sessions.open("h0", 5).tokens[:5] == [5, 6, 7, 8, 9], (
                "the fork copied the session as it was before the pre-draft"
            )
            # The next call ends the fork the verify did not pick, and skips an id not held.
            reply = await draft.ProposeBranches(
                draft_pb2.ProposeBranchesRequest(
                    branches=[
                        draft_pb2.ProposeRequest(
                            session_id="s", keep_tokens=held + 4, num_tokens=1, sampling=sampling, epoch=5
                        )
                    ],
                    end_session_ids=["h0", "never-held"],
                )
            )
            assert [r.error_code for r in reply.results] == [0] and "h0" not in runner.sessions.ids()
            # An end that overtakes a cancelled call (EndSession, or a later call's end_session_ids,
            # before the call that forks) retires the id up to the epoch sent: the late fork opens
            # nothing, where it would be held till its TTL, and a newer call opens it again.
            await draft.EndSession(common_pb2.EndSessionRequest(session_id="h2", discard=True, epoch=7))
            for fork, epoch in (("h0", 3), ("h2", 7), ("h2", 8)):
                late = draft_pb2.ProposeRequest(
                    session_id=fork, fork_from="s", keep_tokens=4, new_tokens=[9], num_tokens=1, sampling=sampling
                )
                late.epoch = epoch
                reply = await draft.ProposeBranches(draft_pb2.ProposeBranchesRequest(branches=[late]))
                opened = epoch == 8
                assert (reply.results[0].error_code == 0) == opened, reply.results[0].error_message
                assert (fork in runner.sessions.ids()) == opened
                if not opened:
                    assert reply.results[0].error_code == grpc.StatusCode.ABORTED.value[0]
                    assert "was ended" in reply.results[0].error_message
            for ending in (["s"], [f"e{i}" for i in range(65)]):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await draft.ProposeBranches(
                        draft_pb2.ProposeBranchesRequest(
                            branches=[draft_pb2.ProposeRequest(session_id="s", num_tokens=1, sampling=sampling)],
                            end_session_ids=ending,
                        )
                    )
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "end" in refused.value.details()
            assert "s" in runner.sessions.ids(), "a refused call ends nothing"
            for branches in (
                [],
                [
                    draft_pb2.ProposeRequest(session_id=f"x{i}", new_tokens=[1], num_tokens=1, sampling=sampling)
                    for i in range(wire.MAX_BRANCHES + 1)
                ],
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await draft.ProposeBranches(draft_pb2.ProposeBranchesRequest(branches=branches))
                assert (
                    refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "branches" in refused.value.details()
                )
            for field, bad in (
                ("runner_ups", {"runner_ups": wire.MAX_RUNNER_UPS + 1}),
                ("guess_rank", {"guess_rank": 1}),  # without guess_first
                ("guess_rank", {"guess_rank": wire.MAX_RUNNER_UPS + 1, "guess_first": True}),
            ):
                request = draft_pb2.ProposeRequest(
                    session_id="r", new_tokens=[1], num_tokens=1, sampling=sampling, **bad
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await draft.ProposeBranches(draft_pb2.ProposeBranchesRequest(branches=[request]))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in refused.value.details()
            assert "r" not in runner.sessions.ids(), "a refused call opens nothing"


async def test_catch_up_steps_survive_lost_sessions_and_leave_none_behind(tiny_pair, reference):
    """A pipelined coordinator whose services forget the request's sessions mid-generation (a
    restart, an eviction): the catch-up pre-draft that finds its session gone fails alone, the
    next round's regular draft call re-sends the sequence, and the greedy output is unchanged."""
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, coordinator_overrides={"pipeline": True}
    ) as stack:
        prompt = PROMPTS[0]
        tokens, stats = [], None
        call = stack.stub.GenerateStream(
            pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=3), timeout=60
        )
        index = 0
        async for chunk in call:
            tokens.extend(chunk.token_ids)
            if index in (1, 3):
                for runner in (stack.draft_runner, stack.target_runner):
                    for session_id in list(runner.sessions._sessions):
                        runner.end_session(session_id)
            if chunk.finish_reason:
                stats = chunk.stats
            index += 1
        assert tokens == reference(prompt, 40)
        assert stats is not None and stats.reprefills >= 2 and stats.catch_up_rounds >= 1, stats
        await _until_no_sessions(stack.draft_runner)
        await _until_no_sessions(stack.target_runner)


@pytest.mark.parametrize(
    "overlap",
    [{"pipeline": True}, {"pipeline": None, "hedges": None, "bonus_guesses": None}],
    ids=["pipelined", "chosen"],
)
async def test_a_pipelined_request_pre_drafts_only_in_rounds_alone_on_its_target(
    tiny_pair, reference, monkeypatch, overlap
):
    """Beside another session on its target replica, a pipelined round runs as a sequential one:
    no pre-draft and no catch-up step (the other's verifies keep the target busy while it
    drafts: `coordinator.adaptive`), and none of the hedges the coordinator chose (each a fork
    holding a draft session). Two greedy requests at once, then one alone: pre-drafts and
    chosen hedges only in rounds costed at one session, outputs the target's. The services are
    costed as on machines of their own: on one shared CPU a loaded request drafts nothing."""
    monkeypatch.setattr(coordinator_server, "shares_cores", lambda draft_info, target_info: False)

    def chooser_costs(draft_runner, target_runner) -> None:  # a cheap draft, a flat verify: K > 0 under load
        draft_runner.pass_costs = PassCosts((1.0,) * 9, 128, tuple((b, 1, 1.0) for b in (2, 4, 8)))
        target_runner.pass_costs = PassCosts((40.0,) * 9, context_tokens=128)

    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        coordinator_overrides={**overlap, "live_costs": False},
        prepare_runners=chooser_costs,
    ) as stack:

        async def generate(prompt: str) -> pb.GenerationStats:
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=40)
            response = await stack.stub.Generate(request, timeout=60)
            assert list(response.token_ids) == reference(prompt)
            return response.stats

        together = await asyncio.gather(*(generate(prompt) for prompt in PROMPTS[:2]))
        alone = await generate(PROMPTS[2])
        for s in (*together, alone):
            assert s.pipelined and len(s.sessions_per_round) == s.rounds
            alone_rounds = list(s.sessions_per_round).count(1)
            assert s.predrafts <= alone_rounds, (s.predrafts, list(s.sessions_per_round))
            assert s.hedges <= MAX_HEDGES * alone_rounds, (s.hedges, list(s.sessions_per_round))
        shared_rounds = sum(n > 1 for s in together for n in s.sessions_per_round)
        assert shared_rounds >= 4 and sum(s.proposed_tokens for s in together) > 0, together
        assert alone.predrafts > 0 and set(alone.sessions_per_round) == {1}
        assert (alone.hedges > 0) == ("hedges" in overlap), alone.hedges
        await _until_no_sessions(stack.draft_runner)


async def test_a_neighbours_ended_request_no_longer_loads_the_next_ones_rounds(tiny_pair, reference, monkeypatch):
    """Another coordinator's session on the same target loads this coordinator's request beside
    it; once it has ended, the next request here is costed alone from its second round on (each
    verify reply says what the target holds), where the pool's Infos alone kept it loaded, its
    rounds sequential, until two more refreshes had seen the neighbour gone (up to 4 s at the
    default refresh)."""
    monkeypatch.setattr(coordinator_server, "shares_cores", lambda draft_info, target_info: False)

    def chooser_costs(draft_runner, target_runner) -> None:  # as in the test above: K > 0 under load
        draft_runner.pass_costs = PassCosts((1.0,) * 9, 128, tuple((b, 1, 1.0) for b in (2, 4, 8)))
        target_runner.pass_costs = PassCosts((40.0,) * 9, context_tokens=128)

    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none"},
        coordinator_overrides={"pipeline": True, "live_costs": False, "pool_refresh_s": 0.25},
        prepare_runners=chooser_costs,
    ) as stack:
        assert stack.target is not None
        slow_down(stack.target_runner, 0.03)  # rounds of 30 ms or more: a refresh takes several

        async def generate() -> list[int]:
            response = await stack.stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=40), timeout=60)
            assert list(response.token_ids) == reference(PROMPTS[0])
            return list(response.stats.sessions_per_round)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.target.port}") as channel:
            neighbour = target_pb2_grpc.TargetStub(channel)
            greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
            opened = target_pb2.VerifyRequest(session_id="neighbour", new_tokens=[5, 6, 7], sampling=greedy)
            await neighbour.Verify(opened)
            await asyncio.sleep(0.6)  # seen by two refreshes in a row
            beside = await generate()
            await neighbour.EndSession(common_pb2.EndSessionRequest(session_id="neighbour"))
        after = await generate()
        assert set(beside) == {2}, beside
        assert set(after[1:]) == {1}, after


async def test_a_request_left_to_the_coordinator_runs_the_overlap_its_costs_favour(tiny_pair, reference, monkeypatch):
    """No overlap flags (auto): with a draft step an eighth of a verify, its rows batched at
    the cost of one, and each model on processors of its own, a greedy request pipelines with
    hedges (coordinator.overlap) and its output is still the target's; a sampled one pipelines
    without them. On a shared host the same flags run plain sequential rounds."""

    def costs(draft_runner, target_runner) -> None:
        draft_runner.pass_costs = PassCosts((5.0,) * 9, 128, tuple((b, 1, 5.0) for b in (2, 4, 8)))
        target_runner.pass_costs = PassCosts((40.0,) * 9, context_tokens=128)

    auto = {"pipeline": None, "hedges": None, "bonus_guesses": None, "live_costs": False}
    for shared in (False, True):
        monkeypatch.setattr(coordinator_server, "shares_cores", lambda draft, target, shared=shared: shared)
        async with inprocess_stack(
            tiny_pair, draft_overrides={"quantize": "none"}, coordinator_overrides=auto, prepare_runners=costs
        ) as running:
            for prompt in PROMPTS:
                response = await running.stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=40), timeout=60)
                assert list(response.token_ids) == reference(prompt), f"shared={shared}: diverged on {prompt!r}"
                s = response.stats
                assert (s.pipelined, s.hedges > 0) == (not shared, not shared), (shared, s.pipelined, s.hedges)
            sampled = await running.stub.Generate(
                pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=3), timeout=60
            )
            assert (sampled.stats.pipelined, sampled.stats.hedges) == (not shared, 0)
            await _until_no_sessions(running.draft_runner)
