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


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> TargetConfig:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__.split(":")[0])
    args = EnvArgs(parser, "SPECDEC_TARGET", env)
    add_model_service_args(args, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    args.add("--device-map", None, "'auto' shards the model over all visible GPUs (overrides --device)")
    ns = parser.parse_args(argv)
    return TargetConfig(**model_service_kwargs(ns, parser), device_map=ns.device_map or None)
