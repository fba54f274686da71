"""Draft service configuration: flags over SPECDEC_DRAFT_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draft_service.runner import PROPOSAL_MODES
from specdec.config import EnvArgs, ModelServiceConfig, add_model_service_args, model_service_kwargs

DEFAULT_PORT = 50061
DEFAULT_METRICS_PORT = 9161
DRAFTERS = ("model", "ngram")
# A sampled proposal is drawn from the draft's own top-k and shipped as (id, prob) pairs:
# 2 KiB per token instead of 0.6 MB of dense float32 over a 152k vocabulary. Exact, since
# it is the distribution the token was drawn from; what it costs in acceptance is measured
# by `python -m bench.draft_truncation` (docs/design.md: Speculation that adapts to the machine).
DEFAULT_PROPOSAL_TOP_K = 256
# HF assisted generation's default `assistant_confidence_threshold`; a request may set its own.
DEFAULT_MIN_CONFIDENCE = 0.4


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    drafter: str = "model"  # "ngram": prompt lookup, no model weights (the tokenizer comes from --model)
    draft_vocab: int = 0  # restrict the draft's output head to this many frequent ids; 0 = full vocabulary
    ngram_min: int = 2  # shortest suffix the prompt-lookup drafter matches
    ngram_max: int = 4  # longest suffix it tries first
    proposal_mode: str = "sample"  # "greedy": propose the draft's argmax even when sampling
    proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K  # draft-side truncation of its own distribution; 0 = off
    min_confidence: float = (
        DEFAULT_MIN_CONFIDENCE  # stop a proposal after a token drawn with less probability; 0 = never
    )


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DraftConfig:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__.split(":")[0])
    args = EnvArgs(parser, "SPECDEC_DRAFT", env)
    add_model_service_args(args, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    args.add(
        "--drafter",
        "model",
        "how to propose: model (a causal LM) or ngram (prompt lookup, no weights)",
        choices=list(DRAFTERS),
    )
    args.add(
        "--draft-vocab", 0, "restrict the draft's output head to the N most frequent token ids (0 = full)", type=int
    )
    args.add("--ngram-min", 2, "prompt lookup: shortest suffix n-gram to match", type=int)
    args.add("--ngram-max", 4, "prompt lookup: longest suffix n-gram, tried first", type=int)
    args.add(
        "--proposal-mode", "sample", "how the draft proposes when the request samples", choices=list(PROPOSAL_MODES)
    )
    args.add(
        "--proposal-top-k",
        DEFAULT_PROPOSAL_TOP_K,
        "sample from the draft's distribution truncated to its top k and ship "
        "that sparsely (0 = full distribution, shipped dense); exact either way",
        type=int,
    )
    args.add(
        "--min-confidence",
        DEFAULT_MIN_CONFIDENCE,
        "stop a proposal early after a token the draft drew with less than this "
        "probability (0 = always propose K; a request may set its own); exact either way",
        type=float,
    )
    ns = parser.parse_args(argv)
    config = DraftConfig(
        **model_service_kwargs(ns, parser),
        drafter=ns.drafter,
        draft_vocab=ns.draft_vocab,
        ngram_min=ns.ngram_min,
        ngram_max=ns.ngram_max,
        proposal_mode=ns.proposal_mode,
        proposal_top_k=ns.proposal_top_k,
        min_confidence=ns.min_confidence,
    )
    if problem := config_problem(config):
        parser.error(problem)
    return config


def config_problem(config: DraftConfig) -> str | None:
    """A contradiction between flags, said in words; None if the config is consistent."""
    if config.drafter == "ngram":
        if not 1 <= config.ngram_min <= config.ngram_max:
            return f"--ngram-min and --ngram-max need 1 <= min <= max; got {config.ngram_min} and {config.ngram_max}"
        if config.quantize == "int8" or config.draft_vocab:
            return "--quantize int8 and --draft-vocab apply to --drafter model; the ngram drafter has no weights"
        return None
    if problem := config.quantize_problem():
        return problem
    if config.draft_vocab < 0:
        return f"--draft-vocab must be >= 0 (0 = full vocabulary); got {config.draft_vocab}"
    if not 0.0 <= config.min_confidence <= 1.0:
        return f"--min-confidence must be in [0, 1] (0 = never stop early); got {config.min_confidence}"
    if config.proposal_top_k < 0:
        return f"--proposal-top-k must be >= 0 (0 = off); got {config.proposal_top_k}"
    return None
