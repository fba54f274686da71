"""The health service's "liveness" name answers SERVING from start-up to exit, whatever the
readiness names ("" and the API's) say: a liveness probe asks it, so a coordinator whose target
pool is down, or any server draining, is taken out of rotation but never restarted for it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.serving import LIVENESS, set_serving, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
import healthcheck  # noqa: E402 (deploy/healthcheck.py, the image's probe)

SERVICE = "specdec.v1.Coordinator"


async def statuses(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            name: (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
            for name in ("", SERVICE, LIVENESS)
        }


async def test_liveness_stays_serving_while_readiness_turns_not_serving():
    running = await start_server(lambda server: None, [SERVICE], "127.0.0.1", 0, 1 << 20)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert await statuses(running.port) == {"": serving, SERVICE: serving, LIVENESS: serving}
        await set_serving(running.health, [SERVICE], False)  # no target replica serving
        assert await statuses(running.port) == {"": not_serving, SERVICE: not_serving, LIVENESS: serving}
        address = f"127.0.0.1:{running.port}"
        probe = await asyncio.to_thread(healthcheck.check, address, service=LIVENESS)
        ready = await asyncio.to_thread(healthcheck.check, address)
        assert (probe, ready) == (True, False)
    finally:
        await running.server.stop(0)
