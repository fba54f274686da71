"""Coordinator gRPC server: connect to draft and target, check the pair, serve Generate."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import PurePath

from prometheus_client import CollectorRegistry

from coordinator.clients import DraftClient, ServiceClient, TargetClient, check_pair, shared_share
from coordinator.config import CoordinatorConfig, parse_config
from coordinator.engine import Engine
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_api import start_http
from coordinator.pair import PairInfo, pair_info
from coordinator.pools import Pool
from coordinator.requests import longest_token_bytes, request_limit_bytes
from coordinator.round_costs import BatchCosts, RoundCosts
from coordinator.rounds import DEFAULT_RULES, RoundRules
from coordinator.servicer import CoordinatorServicer, add_to_server
from specdec.engine.calls import numerics
from specdec.engine.modeling import load_tokenizer, tokenizer_fingerprint
from specdec.rpc.dns import PoolSpec, parse_pool
from specdec.rpc.security import ChannelSecurity, load_client_security, load_server_security
from specdec.rpc.serving import GRPC_MAX_MESSAGE_BYTES, RunningServer, serve_forever, set_serving, start_server
from specdec.v1 import common_pb2, coordinator_pb2

logger = logging.getLogger(__name__)
RPC_ROUND_TRIPS = 5
# How long a stopping coordinator waits for the session ends of requests its grace cut short.
CLEANUP_S = 5.0
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


async def connect(
    config: CoordinatorConfig,
    draft: DraftClient | None = None,
    target: TargetClient | None = None,
    rules: RoundRules = DEFAULT_RULES,
) -> Engine:
    """Waits for a replica of each pool, checks they form a pair, and builds the coordinator.
    `draft` and `target` replace the pools the config describes with one client each
    (in-process services); `rules`: the benchmarks' and tests' comparisons (RoundRules)."""
    upstream = load_client_security(config.upstream, "--upstream-")
    try:
        tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
    except (OSError, ValueError) as exc:  # a folder without one, a mistyped path
        raise ValueError(f"--tokenizer {config.tokenizer}: {exc}") from None
    drafts, targets = build_pools(config, upstream, draft, target)
    first_draft, first_target = await asyncio.gather(
        drafts.start(config.connect_timeout_s), targets.start(config.connect_timeout_s)
    )
    draft_info, target_info = drafts.reference, targets.reference
    assert draft_info is not None and target_info is not None
    check_pair(
        draft_info,
        target_info,
        tokenizer_fingerprint(tokenizer),
        first_draft.address,
        first_target.address,
        config.min_vocab_overlap,
    )
    if draft_info.HasField("vocab_bridge"):
        log_vocab_bridge(draft_info.vocab_bridge)
    costs = await measure_round_costs(first_draft.client, first_target.client, draft_info, target_info)
    pair = pair_info(config, draft_info, target_info, costs)
    log_pair(pair, draft_info, target_info, drafts, targets)
    return Engine(config, drafts, targets, tokenizer, pair, target_info, rules)


def build_pools(
    config: CoordinatorConfig, upstream: ChannelSecurity, draft: DraftClient | None, target: TargetClient | None
) -> tuple[Pool, Pool]:
    """The draft and target pools, not yet started: the config's addresses, or the one client
    given for a role. A pool's replicas found by DNS are reached at their IP addresses, so TLS
    checks their certificates for the pool's name."""
    draft_spec = PoolSpec(draft.address, (draft.address,)) if draft else parse_pool(config.draft_address)
    target_spec = PoolSpec(target.address, (target.address,)) if target else parse_pool(config.target_address)
    draft_security = upstream.for_name(draft_spec.host_name) if draft_spec.dynamic else upstream
    target_security = upstream.for_name(target_spec.host_name) if target_spec.dynamic else upstream
    drafts = Pool(
        "draft",
        draft_spec,
        lambda address: DraftClient(address, config.draft_timeout_s, draft_security),
        config.breaker_failures,
        stuck_after_s=config.draft_timeout_s,
    )
    targets = Pool(
        "target",
        target_spec,
        lambda address: TargetClient(address, config.target_timeout_s, target_security),
        stuck_after_s=config.target_timeout_s,
    )
    for pool, client in ((drafts, draft), (targets, target)):
        if client is not None:
            pool.add(client.address, client)
    return drafts, targets


def log_vocab_bridge(bridge: common_pb2.VocabBridgeInfo) -> None:
    """Logs how many of the target's tokens a draft with its own tokenizer shares, and so drafts within."""
    logger.info(
        "draft %s has its own tokenizer and drafts within the %d tokens it shares with the target's, %.1f%% "
        "of its %d (token-level intersection: exact)",
        bridge.draft_model_id,
        bridge.shared_tokens,
        100 * shared_share(bridge),
        bridge.target_vocab_tokens,
    )


def log_pair(
    pair: PairInfo, draft_info: common_pb2.ModelInfo, target_info: common_pb2.ModelInfo, drafts: Pool, targets: Pool
) -> None:
    """Logs the pair being served, and warns where the target's outputs are a quantised
    model's rather than the checkpoint's."""
    logger.info(
        "pair: draft %s (%s, %s) at %s, target %s (%s, %s) at %s; max K %d%s",
        draft_info.model_id,
        numerics(draft_info.dtype, draft_info.quantization),
        draft_info.device,
        drafts.describe(),
        target_info.model_id,
        pair.target_numerics,
        target_info.device,
        targets.describe(),
        pair.max_num_speculative_tokens,
        f", copies up to {pair.max_copied_tokens} tokens" if pair.draft_copies else "",
    )
    if target_info.quantization:
        logger.warning(
            "the target serves %s: outputs have the distribution of that quantised model, not of the checkpoint "
            "%s as given (start the target with --quantize none for the checkpoint's own)",
            pair.target_numerics,
            target_info.model_id,
        )


async def measure_round_costs(
    draft: ServiceClient, target: ServiceClient, draft_info, target_info, round_trips: int = RPC_ROUND_TRIPS
) -> RoundCosts | None:
    """The K chooser's inputs: both services' calibrated pass costs, and what one call costs
    outside the model, timed here as the fastest of a few Info round trips (the least disturbed
    by whatever else the machine runs). Measured once, so
    the choice of K (and a seed's output) stays put until a restart. None when either service
    did not calibrate (--calibrate off, or a drafter without a model)."""
    if not (draft_info.calibrated_pass_ms and target_info.calibrated_pass_ms):
        logger.info(
            "K chooser off: the %s reports no calibrated pass costs",
            "draft" if not draft_info.calibrated_pass_ms else "target",
        )
        return None
    rpc_ms = {}
    for name, client in (("draft", draft), ("target", target)):
        times = []
        for _ in range(round_trips):
            started = time.perf_counter()
            await client.info()
            times.append((time.perf_counter() - started) * 1e3)
        rpc_ms[name] = min(times)
    costs = RoundCosts(
        draft_pass_ms=tuple(draft_info.calibrated_pass_ms),
        target_pass_ms=tuple(target_info.calibrated_pass_ms),
        draft_rpc_ms=rpc_ms["draft"],
        target_rpc_ms=rpc_ms["target"],
        draft_batch=batch_costs(draft_info),
        target_batch=batch_costs(target_info),
        shared_host=shares_cores(draft_info, target_info),
    )
    logger.info(
        "K chooser costs: draft step %.1f ms, target pass %s ms (1..%d tokens), RPC %.2f / %.2f ms%s",
        costs.draft_ms(1) - costs.draft_rpc_ms,
        "/".join(f"{ms:.0f}" for ms in costs.target_pass_ms),
        len(costs.target_pass_ms),
        costs.draft_rpc_ms,
        costs.target_rpc_ms,
        "; draft and target share this host's cores: under load a draft step is costed as time taken "
        "from every session's target pass"
        if costs.shared_host
        else "",
    )
    return costs


def shares_cores(draft_info, target_info) -> bool:
    """Whether both services compute on the same cores of one machine (ModelInfo.host_id, and
    CPUs that overlap where both say which), so that a draft pass and a target pass take turns
    on them. Not where either runs on an accelerator, is pinned apart (taskset, cpusets), or is held to
    an emulated accelerator's timing (bench.emulated)."""
    draft_cpus, target_cpus = set(draft_info.cpus), set(target_info.cpus)
    return (
        draft_info.device.split(":")[0] == target_info.device.split(":")[0] == "cpu"
        and bool(draft_info.host_id)
        and draft_info.host_id == target_info.host_id
        and (not (draft_cpus and target_cpus) or bool(draft_cpus & target_cpus))
        and not (draft_info.pass_cost_profile or target_info.pass_cost_profile)
    )


def batch_costs(info) -> BatchCosts:
    """A service's batched pass costs, from its Info."""
    return BatchCosts(
        tuple(info.calibrated_pass_ms),
        tuple((cost.sessions, cost.new_tokens, cost.ms) for cost in info.calibrated_batch_ms),
        max(info.max_batch_size, 1),
    )


async def close(coordinator: Engine) -> None:
    """The engine's end, after the drains (no request is left to it). Requests the grace cut
    short end their sessions as they unwind: those calls go out before the channels close, or
    the sessions stay held on the services till their TTL."""
    coordinator.close()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(coordinator.wait_cleanup(), CLEANUP_S)
    await coordinator.upstream.close_clients()


async def build_server(config: CoordinatorConfig, rules: RoundRules = DEFAULT_RULES) -> RunningServer:
    # Before waiting for draft and target: a bad certificate or token file fails at once.
    credentials, interceptors = load_server_security(config.security)
    coordinator = await connect(config, rules=rules)
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.watch_pools(coordinator.upstream)
    servicer = CoordinatorServicer(coordinator, metrics, tokens_checked=bool(config.security.auth_token_file))

    # The public API reads no request larger than a valid one can be (coordinator.requests).
    request_limit = request_limit_bytes(config, coordinator.pair, longest_token_bytes(coordinator.tokenizer))
    logger.info("requests larger than %d bytes are refused before they are read", request_limit)
    http = None
    running: RunningServer | None = None

    def serving() -> bool:  # what the gRPC health says (report_health) and HTTP /health answers
        return running is not None and not running.stopping and bool(coordinator.upstream.targets.serving)

    if config.http_port >= 0:
        model_name = config.served_model_name or served_name(coordinator.pair.target_model_id)
        http, http_port = await start_http(
            coordinator,
            model_name,
            config.host,
            config.http_port,
            config.security,
            metrics,
            min(config.http_max_body_bytes, request_limit),
            serving,
            config.shutdown_grace_s,
        )

    running = await start_server(
        lambda server: add_to_server(servicer, server),
        [SERVICE_NAME],
        config.host,
        config.port,
        GRPC_MAX_MESSAGE_BYTES,  # what it sends: its replies, bounded by the request's limits
        on_stop=functools.partial(close, coordinator),
        credentials=credentials,
        interceptors=interceptors,
        metrics=(registry, config.metrics_port),
        max_receive_bytes=request_limit,
        public=True,
    )
    if http is not None:  # at SIGTERM it stops taking requests and drains beside gRPC, in the same grace
        running.http_port, running.drains = http_port, [http.cleanup]

    async def report_health() -> None:
        """The coordinator serves while its target pool has a replica serving (or one to
        retry: a lone restarting target), and never again once it is shutting down."""
        if not running.stopping:
            await set_serving(running.health, [SERVICE_NAME], serving())

    coordinator.upstream.on_refresh = report_health
    return running


def served_name(model_id: str) -> str:
    """The model name the HTTP API reports by default: the model folder's name, never its path
    (a path tells callers about the server's filesystem)."""
    return PurePath(model_id.rstrip("/\\")).name or model_id


def main(argv: list[str] | None = None, rules: RoundRules = DEFAULT_RULES) -> None:
    config = parse_config(argv)
    asyncio.run(
        serve_forever(
            lambda: build_server(config, rules), config.log_level, "specdec-coordinator", config.shutdown_grace_s
        )
    )
