"""SIGTERM drains the coordinator's HTTP API beside its gRPC server, within --shutdown-grace.
It used to keep taking HTTP requests while gRPC drained, and only then give its streams
aiohttp's own 60 s, past Kubernetes' 30 s grace: they were killed mid-stream and their
sessions held on both services till their TTL. Every pass of the target is slowed, so the
streams are in flight when the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack, slow_down

BODY = {"prompt": "def add(a, b):", "max_tokens": 150, "temperature": 0, "stream": True}


def slow(draft, target) -> None:
    slow_down(target, 0.03)  # a 150-token stream: seconds


@pytest.mark.parametrize("grace_s", [20.0, 1.0], ids=["streams finish", "grace bounds them"])
async def test_http_stops_taking_requests_at_once_and_drains_within_the_grace(tiny_pair, grace_s):
    overrides = {"http_port": 0, "shutdown_grace_s": grace_s}
    async with inprocess_stack(tiny_pair, coordinator_overrides=overrides, prepare_runners=slow) as stack:
        url = f"http://127.0.0.1:{stack.coordinator.http_port}/v1/completions"
        grpc_stream = stack.stub.GenerateStream(pb.GenerateRequest(prompt="x = 1", max_new_tokens=150), timeout=60)
        await grpc_stream.read()  # a gRPC call in flight too: gRPC's drain takes its time
        async with aiohttp.ClientSession() as session, session.post(url, json=BODY) as response:
            first = await response.content.readline()
            started = time.monotonic()
            stopping = asyncio.create_task(stack.coordinator.stop(grace_s))
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession() as other:  # while gRPC drains: refused
                with pytest.raises(aiohttp.ClientConnectionError):
                    await other.post(url, json={**BODY, "stream": False})
            # Within 20 s the stream finishes whole; a grace of 1 s cuts it off.
            with pytest.raises(aiohttp.ClientPayloadError) if grace_s < 2 else contextlib.nullcontext():
                rest = await response.content.read()
                assert (first + rest).rstrip().endswith(b"data: [DONE]")
        await asyncio.wait_for(stopping, grace_s + 5)
        assert time.monotonic() - started < grace_s + 3
