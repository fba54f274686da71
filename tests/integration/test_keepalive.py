"""gRPC keepalive (specdec.rpc.keepalive): a peer lost without a reset (a node gone, a
partition) fails the calls in flight on its connection once a ping goes unanswered, instead of
leaving them to their deadlines; and a server accepts the pings its clients send."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.clients import DraftClient
from specdec.rpc import keepalive
from specdec.rpc.security import aio_channel
from specdec.rpc.serving import create_server
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

FAST = {"KEEPALIVE_TIME_MS": 300, "KEEPALIVE_TIMEOUT_MS": 300}


class StallingLink:
    """A TCP forwarder that can go silent: it stops passing bytes both ways and keeps both
    connections open, as a link to a machine that vanished does (no FIN, no RST)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers += [writer, up_writer]
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the link closed with bytes held

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            await self.flowing.wait()
            writer.write(data)
            await writer.drain()

    def close(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()


async def watch_then_stall(with_keepalive: bool) -> tuple[grpc.StatusCode | None, float]:
    """A Watch stream through the link (a call that stays open) on the coordinator's own channel
    to a service (or a bare one), the link then stalled: the call's status and how long after
    the stall it ended (None: still open after 4 s)."""
    server = create_server(1 << 20)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = StallingLink(port)
    address = f"127.0.0.1:{await link.start()}"
    channel = DraftClient(address, 60.0).channel if with_keepalive else aio_channel(address, [])
    try:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        first = await stream.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(1.0)  # idle with pings flowing: the server must not close the connection
        link.flowing.clear()
        stalled = time.monotonic()
        try:
            await asyncio.wait_for(stream.read(), 4.0)
        except asyncio.TimeoutError:
            stream.cancel()
            return None, time.monotonic() - stalled
        except grpc.aio.AioRpcError as error:
            return error.code(), time.monotonic() - stalled
        raise AssertionError("the stalled stream delivered a message")
    finally:
        link.close()
        await channel.close()
        await server.stop(None)


async def test_a_lost_peer_fails_the_calls_on_its_connection_within_the_keepalive(monkeypatch):
    for name, value in FAST.items():
        monkeypatch.setattr(keepalive, name, value)
    code, after_s = await watch_then_stall(with_keepalive=True)
    assert code is grpc.StatusCode.UNAVAILABLE and after_s < 3.0, (code, after_s)
    # Without the pings, the same call waits on a link that carries nothing.
    code, after_s = await watch_then_stall(with_keepalive=False)
    assert code is None, (code, after_s)


async def test_the_coordinator_closes_a_users_idle_connection_and_the_client_reconnects(tiny_pair, monkeypatch):
    """The public server closes a connection idle past MAX_CONNECTION_IDLE_MS (its client's
    channel goes IDLE, and its next call connects again and is served); the model services'
    servers, whose clients are the coordinator's long-lived channels, do not."""
    monkeypatch.setattr(keepalive, "MAX_CONNECTION_IDLE_MS", 300)
    async with inprocess_stack(tiny_pair) as stack:
        request = pb.GenerateRequest(prompt="def f():", max_new_tokens=2)
        await stack.stub.Generate(request, timeout=30)
        assert stack.channel.get_state() == grpc.ChannelConnectivity.READY
        deadline = time.monotonic() + 10
        while stack.channel.get_state() == grpc.ChannelConnectivity.READY:
            assert time.monotonic() < deadline, "the idle connection was never closed"
            await asyncio.sleep(0.1)
        assert len((await stack.stub.Generate(request, timeout=30)).token_ids) >= 1
        draft = aio_channel(f"127.0.0.1:{stack.draft.port}", [])
        try:
            stub = health_pb2_grpc.HealthStub(draft)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            await asyncio.sleep(1.0)
            assert draft.get_state() == grpc.ChannelConnectivity.READY
        finally:
            await draft.close()
