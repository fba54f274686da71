"""Target service configuration: flags over SPECDEC_TARGET_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config import EnvArgs, ModelServiceConfig, add_model_service_args, model_service_kwargs

DEFAULT_PORT = 50062
DEFAULT_METRICS_PORT = 9162


DEFAULT_BATCH_WINDOW_MS = 2.0
DEFAULT_MAX_BATCH_SIZE = 8


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    device_map: str | None = None  # "auto": shard layers over all visible GPUs (accelerate)
    batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS  # how long a Verify waits for others to share its pass; 0 = never
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # sessions in one verify pass at most
    tensor_parallel: int = 1  # processes (GPUs) every layer is split over; rank 0 serves


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> TargetConfig:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__.split(":")[0])
    args = EnvArgs(parser, "SPECDEC_TARGET", env)
    add_model_service_args(args, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    args.add("--device-map", None, "'auto' shards the model over all visible GPUs (overrides --device)")
    args.add(
        "--batch-window-ms", DEFAULT_BATCH_WINDOW_MS, "milliseconds a Verify call waits for calls from other sessions "
        "to share one forward pass (0 = every call runs alone)", type=float,
    )
    args.add("--max-batch-size", DEFAULT_MAX_BATCH_SIZE, "most sessions verified in one forward pass", type=int)
    args.add(
        "--tensor-parallel", 1, "split every layer over N processes, one per GPU (cuda:0..N-1; gloo on CPU); the "
        "service starts the other ranks itself, or joins the ranks torchrun started", type=int,
    )
    ns = parser.parse_args(argv)
    if ns.batch_window_ms < 0:
        parser.error(f"--batch-window-ms must be >= 0 (0 turns batching off); got {ns.batch_window_ms}")
    if ns.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1 (1 turns batching off); got {ns.max_batch_size}")
    if ns.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be >= 1; got {ns.tensor_parallel}")
    if ns.tensor_parallel > 1 and ns.device_map:
        parser.error("--tensor-parallel and --device-map are exclusive: choose one way to split the model")
    if ns.tensor_parallel > 1 and ns.device not in ("cpu", "cuda"):
        parser.error(f"--tensor-parallel puts rank r on cuda:r; pass --device cuda or cpu, not {ns.device!r}")
    return TargetConfig(
        **model_service_kwargs(ns, parser), device_map=ns.device_map or None,
        batch_window_ms=ns.batch_window_ms, max_batch_size=ns.max_batch_size, tensor_parallel=ns.tensor_parallel,
    )
