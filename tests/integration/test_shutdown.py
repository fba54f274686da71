"""A coordinator stopping while a generation runs past its grace: the client gets a status,
and the generation's sessions on the draft and the target are ended, not left to their TTL."""

from __future__ import annotations

import asyncio

import grpc

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack, slow_down


async def test_a_request_cut_short_by_the_grace_ends_its_sessions(tiny_pair):
    async with inprocess_stack(tiny_pair, prepare_runners=lambda draft, target: slow_down(target, 0.03)) as stack:
        stream = stack.stub.GenerateStream(pb.GenerateRequest(prompt="x = 1", max_new_tokens=200), timeout=60)
        await stream.read()
        assert len(stack.target_runner.sessions) == 1
        stopping = asyncio.create_task(stack.coordinator.stop(1.0))
        try:
            while await stream.read() is not grpc.aio.EOF:
                pass
            code = await stream.code()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        await stopping
        assert code != grpc.StatusCode.OK
        assert (len(stack.target_runner.sessions), len(stack.draft_runner.sessions)) == (0, 0)
