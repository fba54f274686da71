"""The coordinator's hot-path calls as messages on pooled streams (Draft.ProposeStream,
Target.VerifyStream), over real gRPC: a failed call leaves its stream open, a call given up
on (by its caller, its deadline, or its pool) cancels its stream and the work behind it, and
a broken stream empties the pool."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator import clients
from coordinator.clients import DraftClient, TargetClient
from specdec.errors import DeadlineExceeded, SessionNotFound, Unavailable
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from tests.stack import inprocess_stack, slow_down

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def propose(session_id: str, keep: int = 0, num_tokens: int = 3) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        session_id=session_id, keep_tokens=keep, new_tokens=[5, 6, 7], num_tokens=num_tokens, sampling=GREEDY
    )


async def test_each_message_is_one_call_and_a_failed_call_leaves_the_stream_open(tiny_pair):
    async with inprocess_stack(tiny_pair) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
            stream = draft_pb2_grpc.DraftStub(channel).ProposeStream()
            await stream.write(propose("ghost", keep=3))
            failed = await stream.read()
            assert failed.error_code == grpc.StatusCode.NOT_FOUND.value[0] and "ghost" in failed.error_message
            await stream.write(propose("s1"))
            served = await stream.read()
            assert served.error_code == 0 and len(served.proposal.token_ids) == 3
            # The same call as a unary Propose gives the same tokens (greedy).
            unary = await draft_pb2_grpc.DraftStub(channel).Propose(propose("s2"))
            assert list(unary.token_ids) == list(served.proposal.token_ids)
            await stream.done_writing()
            assert await stream.read() is grpc.aio.EOF and await stream.code() == grpc.StatusCode.OK

        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=30)
        target = TargetClient(f"127.0.0.1:{stack.target.port}", timeout_s=30)
        try:
            with pytest.raises(SessionNotFound):
                await draft.propose(propose("ghost", keep=3))
            with pytest.raises(SessionNotFound):
                await target.verify(
                    target_pb2.VerifyRequest(session_id="ghost", keep_tokens=3, new_tokens=[1], sampling=GREEDY)
                )
            pooled = list(draft._proposals._idle)
            assert len(pooled) == 1  # the failed call's stream went back to the pool
            reply = await draft.propose(propose("s3"))
            assert len(reply.token_ids) == 3 and draft._proposals._idle == pooled  # and served the next call
            verified = await target.verify(
                target_pb2.VerifyRequest(
                    session_id="s3", keep_tokens=0, new_tokens=[5, 6, 7], sampling=GREEDY, draft_token_ids=[]
                )
            )
            assert verified.processed_tokens == 3
        finally:
            await draft.close()
            await target.close()


async def test_a_call_past_its_deadline_or_cancelled_cancels_its_stream_and_the_drafting(tiny_pair):
    async with inprocess_stack(tiny_pair, prepare_runners=lambda draft, target: slow_down(draft, 0.2)) as stack:
        runner = stack.draft_runner
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=0.3)
        try:
            with pytest.raises(DeadlineExceeded):
                await draft.propose(propose("late", num_tokens=6))  # 7 passes of > 0.2 s each
            assert draft._proposals._idle == []
            await asyncio.sleep(0.6)  # the service notices the cancelled stream at its next step
            assert runner.stopped_proposals == 1

            task = asyncio.ensure_future(draft.propose(propose("cancelled", num_tokens=6)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.6)
            assert runner.stopped_proposals == 2 and draft._proposals._idle == []

            # Given up on by the pool (its replica stopped answering): the caller, not
            # cancelled itself, gets UNAVAILABLE, and the service stops the work as before.
            # A call's deadline, its allowance included, is what the pool reads while its Info is
            # late (coordinator.pools.Pool._ask): the replica may be busy with it until then.
            loop = asyncio.get_running_loop()
            assert draft.calls_due(loop.time()) is None
            sent = loop.time()
            task = asyncio.ensure_future(draft.propose(propose("abandoned", num_tokens=6), allowance_s=5.0))
            await asyncio.sleep(0.1)
            due = draft.calls_due(loop.time())
            assert due is not None and sent + 5.3 <= due <= sent + 5.3 + 0.1
            assert draft.calls_due(sent - 1.0) is None  # sent after that
            assert draft.abandon_calls("has not answered health probes for 4 s") == 1
            with pytest.raises(Unavailable, match="has not answered health probes for 4 s"):
                await task
            await asyncio.sleep(0.6)
            assert runner.stopped_proposals == 3 and draft.abandon_calls("again") == 0
            assert draft.calls_due(loop.time()) is None
        finally:
            await draft.close()


async def test_a_verify_cancelled_in_its_prefill_stops_it_while_a_call_batched_beside_it_goes_on(tiny_pair):
    """The target's servicer marks a cancelled call's VerifyCall.should_stop: a long prompt's
    prefill, cut in prefix-cache blocks, batched with another session's call, stops at its next
    block, and the other call is answered without waiting for the rest of it."""
    blocks: list[str] = []  # the session of each pass run alone (a prompt's blocks)

    def prepare(draft_runner, target_runner) -> None:
        slow_down(target_runner, 0.03)
        plain = target_runner._forward_admitted

        def counted(session, token_ids, logits_to_keep):
            blocks.append(session.session_id)
            return plain(session, token_ids, logits_to_keep)

        target_runner._forward_admitted = counted

    overrides = {"prefix_cache_bytes": 1 << 24, "prefix_block_tokens": 8, "batch_window_ms": 20.0}
    async with inprocess_stack(tiny_pair, target_overrides=overrides, prepare_runners=prepare) as stack:
        target = TargetClient(f"127.0.0.1:{stack.target.port}", timeout_s=30)

        def verify(session_id: str, keep: int, new_tokens: list[int]):
            request = target_pb2.VerifyRequest(
                session_id=session_id, keep_tokens=keep, new_tokens=new_tokens, sampling=GREEDY
            )
            return asyncio.ensure_future(target.verify(request))

        try:
            # Two sessions decoding (recently active): the batcher waits its window for the other's
            # call, and takes the new session's prompt (a fresh one goes in blocks) beside "short".
            await asyncio.gather(verify("idle", 0, [5, 6, 7]), verify("short", 0, [5, 6, 7]))
            short = verify("short", 3, [8])
            prompt = [(7 * i + 3) % 40 + 1 for i in range(24 * 8)]  # 24 block passes of over 30 ms
            long = verify("long", 0, prompt)
            await asyncio.sleep(0.12)  # a few of them
            long.cancel()
            assert (await asyncio.wait_for(short, 5.0)).sequence_length == 4
            assert blocks.count("long") < 20, f"{blocks.count('long')} of 24 blocks ran for no one"
            await asyncio.sleep(0.05)
            assert "long" not in stack.target_runner.sessions.ids()
        finally:
            await target.close()


async def test_a_broken_stream_empties_the_pool(tiny_pair):
    async with inprocess_stack(tiny_pair) as stack:
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=5)
        try:
            await asyncio.gather(*(draft.propose(propose(f"s{i}")) for i in range(3)))
            assert len(draft._proposals._idle) == 3  # three calls at once: three streams
            await stack.draft.stop(0)
            with pytest.raises(Unavailable):
                await draft.propose(propose("after"))
            assert draft._proposals._idle == []  # a retry opens a fresh stream, not another dead one
        finally:
            await draft.close()


async def test_branch_calls_go_as_messages_and_a_cancelled_one_stops_its_branches(tiny_pair):
    """Draft.ProposeBranchesStream: a call the service refuses answers with its status and
    leaves the stream open; DraftClient.propose_branches sends on a pooled stream; a call given
    up on cancels its stream, and the draft stops every branch at its next step."""
    async with inprocess_stack(tiny_pair) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
            stream = draft_pb2_grpc.DraftStub(channel).ProposeBranchesStream()
            await stream.write(draft_pb2.ProposeBranchesRequest())  # no branches
            refused = await stream.read()
            assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "branches" in refused.error_message
            await stream.write(draft_pb2.ProposeBranchesRequest(branches=[propose("b1"), propose("b2", num_tokens=2)]))
            served = await stream.read()
            assert served.error_code == 0 and [len(r.proposal.token_ids) for r in served.response.results] == [3, 2]
            await stream.done_writing()

        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=30)
        try:
            reply = await draft.propose_branches(draft_pb2.ProposeBranchesRequest(branches=[propose("b3")]))
            assert len(reply.results[0].proposal.token_ids) == 3 and len(draft._branches._idle) == 1
            slow_down(stack.draft_runner, 0.2)
            task = asyncio.ensure_future(
                draft.propose_branches(draft_pb2.ProposeBranchesRequest(branches=[propose("b4", num_tokens=6)]))
            )
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.6)
            assert stack.draft_runner.stopped_proposals == 1 and draft._branches._idle == []
        finally:
            await draft.close()


async def test_a_pre_draft_joins_the_decode_batch_running_for_another_session(tiny_pair):
    """A pipelined round's pre-draft (ProposeBranches) arriving while another session's call
    is drafting steps beside it in the running decode batch, and is answered when its own
    drafts are done, not after that call's: a pre-draft that ran alone after the batch made
    every session of a shared draft wait for every other's pre-draft. Its drafts are those it
    drafts alone (greedy)."""
    async with inprocess_stack(tiny_pair) as stack:
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=30)
        try:
            for session_id in ("long", "alone", "joins"):
                await draft.propose(propose(session_id, num_tokens=2))  # each holds 3 tokens and 2 drafts

            def pre_draft(session_id: str) -> draft_pb2.ProposeBranchesRequest:
                request = propose(session_id, keep=5, num_tokens=3)
                del request.new_tokens[:]
                request.guess_first = True
                return draft_pb2.ProposeBranchesRequest(branches=[request])

            lone = await draft.propose_branches(pre_draft("alone"))
            slow_down(stack.draft_runner, 0.1)
            finished: list[str] = []

            async def call(name: str, reply):
                result = await reply
                finished.append(name)
                return result

            long = asyncio.ensure_future(call("long", draft.propose(propose("long", keep=5, num_tokens=8))))
            await asyncio.sleep(0.25)  # the long call's batch is stepping
            joined = await call("joins", draft.propose_branches(pre_draft("joins")))
            assert len((await long).token_ids) == 8
            assert finished == ["joins", "long"]
            assert list(joined.results[0].proposal.token_ids) == list(lone.results[0].proposal.token_ids)
        finally:
            await draft.close()


async def test_a_call_failed_on_the_service_marks_its_client_span_as_a_unary_calls_would(tiny_pair, monkeypatch):
    """Tracing on: a stream call answered with an error code ends its client span ERROR with
    rpc.grpc.status_code, as the unary interceptor records a failed call; a served one OK."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from specdec.rpc import telemetry

    provider, spans = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(telemetry, "_provider", provider)
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer("test"))
    async with inprocess_stack(tiny_pair) as stack:
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=30)
        try:
            with pytest.raises(SessionNotFound):
                await draft.propose(propose("ghost", keep=3))
            await draft.propose(propose("s1"))
        finally:
            await draft.close()
    failed, served = [s for s in spans.get_finished_spans() if s.attributes.get("specdec.on_stream")]
    assert failed.status.status_code == StatusCode.ERROR and "ghost" in failed.status.description
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert served.status.status_code == StatusCode.UNSET and served.attributes["rpc.grpc.status_code"] == 0


async def test_an_end_session_the_service_did_not_answer_is_sent_again_once_it_does(tiny_pair, monkeypatch):
    """A replica frozen for a while (SIGSTOP, a stalled machine) does not answer the
    EndSessions of the sessions moved off it; once it answers again they are sent again, as
    the pool does at its first Info heard afresh (coordinator.pools). Before, they held the
    replica's KV and places, counted as other coordinators' load, until its session TTL ran
    out after it resumed (five minutes by default)."""
    monkeypatch.setattr(clients, "END_SESSION_TIMEOUT_S", 0.2)
    async with inprocess_stack(tiny_pair, prepare_runners=lambda draft, target: slow_down(draft, 0.4)) as stack:
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", timeout_s=30)
        try:
            await draft.propose(propose("moved", num_tokens=1))
            busy = asyncio.ensure_future(draft.propose(propose("busy", num_tokens=3)))  # the model thread's, 1.6 s
            await asyncio.sleep(0.1)
            await draft.end_session("moved", discard=True)  # waits behind it: past its deadline
            assert draft.unended == 1 and stack.draft_runner.sessions.open("moved", 1)
            draft.forget_unended("busy")  # another session's place: nothing to forget
            await busy
            await draft.end_unended()
            assert draft.unended == 0
            with pytest.raises(SessionNotFound):
                stack.draft_runner.sessions.open("moved", 1)
        finally:
            await draft.close()
