"""Target gRPC server: build it from a config, serve until a signal."""

from __future__ import annotations

import asyncio
import logging

import torch

from target_service.config import TargetConfig
from target_service.runner import TargetRunner
from target_service.servicer import TargetServicer
from specdec.modeling import load_causal_lm
from specdec.serving import ModelThread, RunningServer, configure_logging, expire_sessions_periodically, start_server
from specdec.v1 import target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


def load_runner(config: TargetConfig) -> TargetRunner:
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_causal_lm(config.model, config.dtype, config.device, config.device_map)
    return TargetRunner(
        loaded,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
    )


async def build_server(config: TargetConfig, runner: TargetRunner | None = None) -> RunningServer:
    """Starts the server (loading the model unless a runner is given); `.port` is the bound port."""
    runner = runner or load_runner(config)
    model_thread = ModelThread("target-model")
    servicer = TargetServicer(runner, model_thread)
    return await start_server(
        lambda server: target_pb2_grpc.add_TargetServicer_to_server(servicer, server),
        [SERVICE_NAME],
        config.host,
        config.port,
        config.max_message_bytes,
        background=[lambda: expire_sessions_periodically(model_thread, runner.expire_sessions, min(config.session_ttl_s, 30.0))],
        on_stop=model_thread.shutdown,
    )


async def serve(config: TargetConfig) -> None:
    configure_logging(config.log_level)
    running = await build_server(config)
    await running.serve_until_signal()


def main(argv: list[str] | None = None) -> None:
    from target_service.config import parse_config

    asyncio.run(serve(parse_config(argv)))
