"""Draft gRPC server: build it from a config, serve until a signal."""

from __future__ import annotations

import asyncio
import logging

import torch

from draft_service.config import DraftConfig, parse_config
from draft_service.runner import DraftRunner
from draft_service.servicer import DraftServicer
from specdec.modeling import load_causal_lm
from specdec.serving import RunningServer, serve_forever, start_model_server
from specdec.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


def load_runner(config: DraftConfig) -> DraftRunner:
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_causal_lm(config.model, config.dtype, config.device)
    return DraftRunner(
        loaded,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
        proposal_mode=config.proposal_mode,
        proposal_top_k=config.proposal_top_k,
    )


async def build_server(config: DraftConfig, runner: DraftRunner | None = None) -> RunningServer:
    """Starts the server (loading the model unless a runner is given); `.port` is the bound port."""
    return await start_model_server(
        config, runner or load_runner(config), DraftServicer, draft_pb2_grpc.add_DraftServicer_to_server, SERVICE_NAME
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    asyncio.run(serve_forever(lambda: build_server(config), config.log_level))
