"""The in-process channel behaves as a grpc.aio channel does for what the stacks use: status
codes from aborts, deadlines, unknown methods, streaming, and serialisation both ways."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.rpc.local import LocalChannel

SERVING = health_pb2.HealthCheckResponse.SERVING


async def health_channel() -> tuple[LocalChannel, health.aio.HealthServicer]:
    channel = LocalChannel()
    servicer = health.aio.HealthServicer()
    await servicer.set("up", SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, channel)
    return channel, servicer


async def test_unary_call_round_trips_through_the_codecs():
    channel, _ = await health_channel()
    request = health_pb2.HealthCheckRequest(service="up")
    reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
    assert reply.status == SERVING
    assert isinstance(reply, health_pb2.HealthCheckResponse)


async def test_an_abort_reaches_the_client_as_its_status_code():
    channel, _ = await health_channel()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="nope"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def test_server_streaming_yields_each_message():
    channel, servicer = await health_channel()
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="up"))
    first = await anext(stream)
    await servicer.set("up", health_pb2.HealthCheckResponse.NOT_SERVING)
    second = await anext(stream)
    await stream.aclose()
    assert (first.status, second.status) == (SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


async def test_a_deadline_ends_the_call_and_cancels_the_handler():
    cancelled = asyncio.Event()

    async def slow(request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return request

    channel = LocalChannel()
    channel.add_registered_method_handlers("t.S", {"Slow": grpc.unary_unary_rpc_method_handler(slow)})
    call = channel.unary_unary("/t.S/Slow", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(b"x", timeout=0.05)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled.is_set()


async def test_unknown_methods_closed_channels_and_handler_crashes_have_their_codes():
    async def crash(request: bytes, context) -> bytes:
        raise RuntimeError("boom")

    channel = LocalChannel()
    channel.add_registered_method_handlers("t.S", {"Crash": grpc.unary_unary_rpc_method_handler(crash)})
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary("/t.S/Crash", **identity)(b"x")
    assert raised.value.code() == grpc.StatusCode.UNKNOWN and "boom" in raised.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary("/t.S/Missing", **identity)(b"x")
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    await channel.close()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary("/t.S/Crash", **identity)(b"x")
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
