"""Target gRPC server: build it from a config, serve until a signal."""

from __future__ import annotations

import asyncio
import logging

import torch

from target_service.config import TargetConfig, parse_config
from target_service.runner import TargetRunner
from target_service.servicer import TargetServicer
from specdec.modeling import load_causal_lm
from specdec.security import load_server_security
from specdec.serving import ModelThread, RunningServer, serve_forever, start_model_server
from specdec.v1 import target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


def load_runner(config: TargetConfig) -> TargetRunner:
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_causal_lm(config.model, config.dtype, config.device, config.device_map, config.trust_remote_code)
    return TargetRunner(
        loaded,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
        max_kv_bytes=config.max_kv_bytes,
    )


async def build_server(config: TargetConfig, runner: TargetRunner | None = None) -> RunningServer:
    """Starts the server (loading the model unless a runner is given); `.port` is the bound port."""
    # Before the weights load: a bad certificate or token file fails in seconds, not minutes.
    credentials, interceptors = load_server_security(config.security)
    def make_servicer(runner: TargetRunner, model_thread: ModelThread, metrics) -> TargetServicer:
        return TargetServicer(runner, model_thread, metrics, config.batch_window_ms / 1e3, config.max_batch_size)

    return await start_model_server(
        config, runner or load_runner(config), make_servicer, target_pb2_grpc.add_TargetServicer_to_server, SERVICE_NAME,
        credentials, interceptors,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    asyncio.run(serve_forever(lambda: build_server(config), config.log_level, "specdec-target", config.shutdown_grace_s))
