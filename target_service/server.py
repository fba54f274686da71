"""Target gRPC server: build it from a config, serve until a signal."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import cast

from transformers import AutoConfig

from specdec.engine.modeling import check_tensor_parallel
from specdec.rpc.model_thread import ModelThread
from specdec.rpc.ports import free_port
from specdec.rpc.security import load_server_security
from specdec.rpc.serving import (
    RunningServer,
    configure_logging,
    leave_torch_to_the_model_thread,
    serve_forever,
    start_model_server,
)
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service import tensor_parallel
from target_service.config import TargetConfig, parse_config
from target_service.loading import load_runner
from target_service.runner import TargetRunner
from target_service.servicer import TargetServicer

logger = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


async def build_server(
    config: TargetConfig, runner: TargetRunner | None = None, model_thread: ModelThread | None = None
) -> RunningServer:
    """Starts the server (loading the model unless a runner is given); `.port` is the bound port.
    `model_thread`: one its caller owns and may share (specdec.rpc.serving.start_model_server)."""
    # Before the weights load: a bad certificate or token file fails in seconds, not minutes.
    credentials, interceptors = load_server_security(config.security)
    return await start_model_server(
        config,
        runner,
        lambda: load_runner(config),
        TargetServicer,
        target_pb2_grpc.add_TargetServicer_to_server,
        SERVICE_NAME,
        credentials,
        interceptors,
        model_thread,
    )


def main(argv: list[str] | None = None, pass_cost_profile: str = "") -> None:
    """`python -m target_service`; `pass_cost_profile` emulates an accelerator (bench.emulated)."""
    config = dataclasses.replace(parse_config(argv), pass_cost_profile=pass_cost_profile)
    if config.tensor_parallel > 1:
        return main_tensor_parallel(config)
    config = leave_torch_to_the_model_thread(config)
    asyncio.run(
        serve_forever(lambda: build_server(config), config.log_level, "specdec-target", config.shutdown_grace_s)
    )


def main_tensor_parallel(config: TargetConfig) -> None:
    """Rank 0 serves; ranks 1..N-1 replay its calls. Started alone, this process is rank 0 and
    spawns the others on this host; under torchrun (RANK/WORLD_SIZE set) every rank runs this."""
    configure_logging(config.log_level)
    try:  # before any rank starts: a split that cannot work fails in a second
        check_tensor_parallel(
            AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code), config.tensor_parallel
        )
    except (OSError, ValueError) as exc:
        logger.error("cannot start: %s", exc)
        raise SystemExit(2) from None
    launched = tensor_parallel.rank_from_environment()
    if launched is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        workers = tensor_parallel.spawn_workers(config, init_method, load_runner)
        stopping = tensor_parallel.exit_when_a_worker_dies(workers)
        rank, local_rank = 0, 0
    else:
        if launched.world_size != config.tensor_parallel:
            raise SystemExit(
                f"--tensor-parallel {config.tensor_parallel} but the launcher started {launched.world_size} ranks"
            )
        init_method, rank, local_rank = "env://", launched.rank, launched.local_rank
        workers, stopping = [], None
    control = tensor_parallel.init_rank(rank, config.tensor_parallel, local_rank, config.device, init_method)
    if rank > 0:
        tensor_parallel.serve_worker(load_runner(config), control, rank)
        return

    runners: list[tensor_parallel.TensorParallelRunner] = []

    async def build() -> RunningServer:
        runners.append(tensor_parallel.TensorParallelRunner(load_runner(config), control, config.tensor_parallel))
        # A TensorParallelRunner serves as a TargetRunner: it forwards every call to rank 0's runner.
        return await build_server(config, cast(TargetRunner, runners[0]))

    try:
        asyncio.run(serve_forever(build, config.log_level, "specdec-target", config.shutdown_grace_s))
    finally:
        # The server has drained, so no call is using the control group any more.
        if stopping is not None:
            stopping.set()
        if runners:
            runners[0].stop_workers()
        for process in workers:
            process.join(timeout=10)
