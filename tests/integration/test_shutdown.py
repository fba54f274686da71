"""A coordinator stopping while a generation runs past its grace: the client gets a status,
and the generation's sessions on the draft and the target are ended, not left to their TTL."""

from __future__ import annotations

import asyncio

import grpc

from specdec.rpc.servicer_base import MID_REQUEST_S
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


async def test_a_stopping_model_service_drains_its_requests_then_ends_the_idle_call_streams(tiny_pair):
    """The coordinator keeps its call streams to a service open between calls: a stopping
    service serves the request in flight to its end over them, then, with no session used
    for a while, ends the idle ones and stops, rather than sitting out its whole grace."""
    async with inprocess_stack(tiny_pair, prepare_runners=lambda draft, target: slow_down(target, 0.02)) as stack:
        request = pb.GenerateRequest(prompt="x = 1", max_new_tokens=40, num_speculative_tokens=2)
        stream = stack.stub.GenerateStream(request, timeout=60)
        await stream.read()
        stopping = asyncio.create_task(stack.target.stop(60.0))
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            last = chunk
        assert last.finish_reason == "length" and await stream.code() == grpc.StatusCode.OK
        ended = asyncio.get_running_loop().time()
        await stopping  # its sessions stay open (EndSession is refused) until MID_REQUEST_S after their last call
        assert asyncio.get_running_loop().time() - ended < MID_REQUEST_S + 15.0  # not the 60 s grace
        started = asyncio.get_running_loop().time()
        await stack.draft.stop(20.0)  # idle: at once
        assert asyncio.get_running_loop().time() - started < 2.0
