"""Target service configuration: flags over SPECDEC_TARGET_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config import EnvArgs, ModelServiceConfig, add_model_service_args, model_service_kwargs

DEFAULT_PORT = 50062
DEFAULT_METRICS_PORT = 9162


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    device_map: str | None = None  # "auto": shard layers over all visible GPUs (accelerate)
    tensor_parallel: int = 1  # processes (GPUs) every layer is split over; rank 0 serves

    def resolved_quantize(self) -> str:
        """A split model (device map, tensor parallel) is never quantised by `auto`."""
        if self.quantize == "auto" and (self.tensor_parallel > 1 or self.device_map):
            return "none"
        return super().resolved_quantize()


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> TargetConfig:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__.split(":")[0])
    args = EnvArgs(parser, "SPECDEC_TARGET", env)
    add_model_service_args(args, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    args.add("--device-map", None, "'auto' shards the model over all visible GPUs (overrides --device)")
    args.add(
        "--tensor-parallel",
        1,
        "split every layer over N processes, one per GPU (cuda:0..N-1; gloo on CPU); the "
        "service starts the other ranks itself, or joins the ranks torchrun started",
        type=int,
    )
    ns = parser.parse_args(argv)
    if ns.tensor_parallel < 1:
        parser.error(f"--tensor-parallel must be >= 1; got {ns.tensor_parallel}")
    if ns.tensor_parallel > 1 and ns.device_map:
        parser.error("--tensor-parallel and --device-map are exclusive: choose one way to split the model")
    if ns.tensor_parallel > 1 and ns.device not in ("cpu", "cuda"):
        parser.error(f"--tensor-parallel puts rank r on cuda:r; pass --device cuda or cpu, not {ns.device!r}")
    config = TargetConfig(
        **model_service_kwargs(ns, parser),
        device_map=ns.device_map or None,
        tensor_parallel=ns.tensor_parallel,
    )
    if problem := config.quantize_problem():
        parser.error(problem)
    if config.quantize == "int8" and (config.tensor_parallel > 1 or config.device_map):
        parser.error(
            "--quantize int8 runs the whole model on one CPU; it cannot be combined with --tensor-parallel or "
            "--device-map"
        )
    return config
