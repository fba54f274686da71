"""Target service configuration: flags over SPECDEC_TARGET_* environment variables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config.services import ModelServiceConfig, metrics_port_setting, port_setting, quantize_setting
from specdec.config.settings import parse_settings, setting

DEFAULT_PORT = 50062
DEFAULT_METRICS_PORT = 9162


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    port: int = port_setting(DEFAULT_PORT)
    metrics_port: int = metrics_port_setting(DEFAULT_METRICS_PORT)
    # The model it is given, unless int8 is asked for by name: the target's numerics are the output's.
    quantize: str = quantize_setting("none")
    tensor_parallel: int = setting(
        1,
        "--tensor-parallel",
        "split every layer over N processes, one per GPU (cuda:0..N-1; gloo on CPU); the "
        "service starts the other ranks itself, or joins the ranks torchrun started",
        more="Exclusive with `--device auto`.",
    )

    @property
    def device_map(self) -> str | None:
        """accelerate's device map: "auto" (--device auto: consecutive layers over every visible GPU) or None."""
        return "auto" if self.device == "auto" else None

    def resolved_quantize(self) -> str:
        """A split model (device map, tensor parallel) is never quantised by `auto`."""
        if self.quantize == "auto" and (self.tensor_parallel > 1 or self.device_map):
            return "none"
        return super().resolved_quantize()

    def problem(self) -> str | None:
        """A contradiction between flags, said in words; None if the config is consistent."""
        if self.tensor_parallel < 1:
            return f"--tensor-parallel must be >= 1; got {self.tensor_parallel}"
        if self.tensor_parallel > 1 and self.device_map:
            return "--tensor-parallel and --device auto are exclusive: choose one way to split the model"
        if self.tensor_parallel > 1 and self.device not in ("cpu", "cuda"):
            return f"--tensor-parallel puts rank r on cuda:r; pass --device cuda or cpu, not {self.device!r}"
        if problem := super().problem():
            return problem
        if self.prefix_cache_bytes and self.tensor_parallel > 1:
            return "--prefix-cache-bytes is not supported with --tensor-parallel yet (each rank would keep its own)"
        if self.quantize == "int8" and (self.tensor_parallel > 1 or self.device_map):
            return (
                "--quantize int8 runs the whole model on one CPU; it cannot be combined with --tensor-parallel or "
                "--device auto"
            )
        return None


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> TargetConfig:
    return parse_settings(TargetConfig, "SPECDEC_TARGET", argv, env, "python -m target_service", "Target service")
