"""Draft service configuration: flags over SPECDEC_DRAFT_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draft_service.runner import PROPOSAL_MODES
from specdec.config import EnvArgs, ModelServiceConfig, add_model_service_args, model_service_kwargs

DEFAULT_PORT = 50061


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    proposal_mode: str = "sample"  # "greedy": propose the draft's argmax even when sampling
    proposal_top_k: int = 0  # draft-side truncation of its own distribution; 0 = off


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DraftConfig:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__.split(":")[0])
    args = EnvArgs(parser, "SPECDEC_DRAFT", env)
    add_model_service_args(args, DEFAULT_PORT)
    args.add("--proposal-mode", "sample", "how the draft proposes when the request samples", choices=list(PROPOSAL_MODES))
    args.add("--proposal-top-k", 0, "truncate the draft's distribution to its top k (0 = off); exact either way", type=int)
    ns = parser.parse_args(argv)
    return DraftConfig(**model_service_kwargs(ns, parser), proposal_mode=ns.proposal_mode, proposal_top_k=ns.proposal_top_k)
