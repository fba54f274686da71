"""Coordinator gRPC server: connect to draft and target, check the pair, serve Generate."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from coordinator.clients import DraftClient, TargetClient, check_pair
from coordinator.config import CoordinatorConfig, parse_config
from coordinator.metrics import CoordinatorMetrics
from coordinator.pipeline import Coordinator, PairInfo
from coordinator.servicer import CoordinatorServicer, add_to_server
from specdec.modeling import tokenizer_fingerprint, warn_if_trusting_remote_code
from specdec.security import load_client_security, load_server_security
from specdec.serving import RunningServer, serve_forever, start_server
from specdec.v1 import coordinator_pb2

logger = logging.getLogger(__name__)
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


async def connect(config: CoordinatorConfig) -> Coordinator:
    """Waits for both services, checks they form a pair, and builds the coordinator."""
    upstream = load_client_security(config.upstream, "--upstream-")
    warn_if_trusting_remote_code(config.tokenizer, config.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
    draft = DraftClient(config.draft_address, config.draft_timeout_s, config.max_message_bytes, upstream)
    target = TargetClient(config.target_address, config.target_timeout_s, config.max_message_bytes, upstream)
    draft_info, target_info = await asyncio.gather(
        draft.wait_info(config.connect_timeout_s), target.wait_info(config.connect_timeout_s)
    )
    check_pair(draft_info, target_info, tokenizer_fingerprint(tokenizer), config.draft_address, config.target_address)
    pair = PairInfo(
        vocab_size=min(draft_info.vocab_size, target_info.vocab_size),
        eos_token_ids=frozenset(target_info.eos_token_ids),
        max_context=target_info.max_context,
        draft_max_context=draft_info.max_context,
        max_num_speculative_tokens=min(
            config.max_num_speculative_tokens, draft_info.max_speculative_tokens, target_info.max_speculative_tokens
        ),
    )
    logger.info(
        "pair: draft %s (%s, %s) at %s, target %s (%s, %s) at %s; max K %d",
        draft_info.model_id, draft_info.dtype, draft_info.device, config.draft_address,
        target_info.model_id, target_info.dtype, target_info.device, config.target_address,
        pair.max_num_speculative_tokens,
    )
    return Coordinator(config, draft, target, tokenizer, pair)


async def build_server(config: CoordinatorConfig) -> RunningServer:
    # Before waiting for draft and target: a bad certificate or token file fails at once.
    credentials, interceptors = load_server_security(config.security)
    coordinator = await connect(config)
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.watch_breaker(coordinator.breaker)
    servicer = CoordinatorServicer(coordinator, metrics)

    def close_channels() -> None:
        coordinator.close()
        for client in (coordinator.draft, coordinator.target):
            asyncio.get_running_loop().create_task(client.close())

    return await start_server(
        lambda server: add_to_server(servicer, server),
        [SERVICE_NAME],
        config.host,
        config.port,
        config.max_message_bytes,
        on_stop=close_channels,
        credentials=credentials,
        interceptors=interceptors,
        metrics=(registry, config.metrics_port),
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    asyncio.run(serve_forever(lambda: build_server(config), config.log_level, "specdec-coordinator", config.shutdown_grace_s))
