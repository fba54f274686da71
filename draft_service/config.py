"""Draft service configuration: flags over SPECDEC_DRAFT_* environment variables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draft_service.suffix import DEFAULT_MAX_MATCH
from specdec.config.services import ModelServiceConfig, metrics_port_setting, port_setting
from specdec.config.settings import fixed, parse_settings, setting

DEFAULT_PORT = 50061
DEFAULT_METRICS_PORT = 9161
DRAFTERS = ("model", "ngram", "hybrid", "suffix", "eagle")
# HF assisted generation's default `assistant_confidence_threshold`; a request may set its own.
DEFAULT_MIN_CONFIDENCE = 0.4
# About 40 MB with its index; many times the text of a day's repeated agent runs at a few
# hundred tokens each.
DEFAULT_SUFFIX_CACHE_TOKENS = 262_144


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    port: int = port_setting(DEFAULT_PORT)
    metrics_port: int = metrics_port_setting(DEFAULT_METRICS_PORT)
    drafter: str = setting(
        "model",
        "--drafter",
        "how to propose: model (a causal LM), ngram (prompt lookup, no weights; the tokenizer comes from --model) "
        "hybrid (prompt lookup where the sequence's last n-gram recurs, the model otherwise), suffix (as hybrid, "
        "also looking in earlier requests' prompts and outputs) or eagle (a one-layer head reading the target's hidden "
        "features: --model is then the target's folder, --draft-head the head's)",
        choices=DRAFTERS,
        more="See [Drafters](design.md#drafters).",
    )
    draft_head: str = setting(
        "",
        "--draft-head",
        "eagle drafter: the head's folder (EAGLE-1 or EAGLE-3 as released, or one specdec.tools.train_head wrote)",
        more="See [EAGLE heads](design.md#eagle-heads).",
    )
    draft_vocab: int = setting(
        0,
        "--draft-vocab",
        "restrict the draft's output head to the N lowest (most frequent BPE) ids plus special tokens (0 = full)",
    )
    target_tokenizer: str = setting(
        "",
        "--target-tokenizer",
        "the target's model (or tokenizer) folder when its tokenizer differs from the draft's: the draft reads the "
        "target's ids and proposes only tokens both vocabularies share (token-level intersection; exact)",
        more="See [Drafts with another tokenizer](design.md#drafts-with-another-tokenizer).",
    )
    min_confidence: float = setting(
        DEFAULT_MIN_CONFIDENCE,
        "--min-confidence",
        "stop a proposal early after a token the draft drew with less than this probability "
        "(HF's assistant_confidence_threshold; 0 = always propose K; a request may set its own); exact either way",
    )
    # No flags (issue 66: a surface a user can hold): one value for every deployment.
    ngram_min: int = fixed(
        2, "prompt lookup (ngram, hybrid, suffix): the shortest suffix n-gram to match; no other was measured to pay"
    )
    ngram_max: int = fixed(4, "prompt lookup (ngram, hybrid): the longest suffix n-gram, tried first")
    suffix_cache_tokens: int = fixed(
        DEFAULT_SUFFIX_CACHE_TOKENS,
        "suffix drafter: tokens of earlier requests (prompt and output) kept to propose from, over every cache "
        "namespace together (a request reads only its own: its cache_salt and bearer token), oldest dropped first, "
        "whichever namespace's: about 40 MB with its index",
    )

    def problem(self) -> str | None:
        """A contradiction between flags, said in words; None if the config is consistent."""
        if self.device == "auto":
            return "--device auto (layers over every visible GPU) is the target's; give the draft one device"
        if self.drafter in ("ngram", "hybrid", "suffix") and not 1 <= self.ngram_min <= self.ngram_max:
            return f"ngram_min must be in [1, {self.ngram_max}]; got {self.ngram_min}"
        if (self.drafter == "eagle") != bool(self.draft_head):
            return "--draft-head goes with --drafter eagle, and --drafter eagle needs a --draft-head"
        if not 0.0 <= self.min_confidence <= 1.0:
            return f"--min-confidence must be in [0, 1] (0 = never stop early); got {self.min_confidence}"
        if self.drafter == "ngram":
            if self.quantize == "int8" or self.draft_vocab or self.target_tokenizer:
                return (
                    "--quantize int8, --draft-vocab and --target-tokenizer apply to a drafter "
                    "with a model; the ngram drafter has no weights, runs no pass and speaks its --model's ids"
                )
            if self.max_kv_bytes or self.prefix_cache_bytes:
                return (
                    "--max-kv-bytes and --prefix-cache-bytes apply to a drafter with a model: the ngram drafter holds "
                    "no KV"
                )
            return super().problem()
        if problem := super().problem():
            return problem
        if self.drafter == "eagle" and (self.draft_vocab or self.target_tokenizer or self.prefix_cache_bytes):
            return (
                "--draft-vocab, --target-tokenizer and --prefix-cache-bytes do not apply to --drafter eagle: its "
                "vocabulary is its head's, and its --model is its target's folder"
            )
        if self.drafter == "suffix" and self.suffix_cache_tokens < 1:
            return f"suffix_cache_tokens must be >= 1; got {self.suffix_cache_tokens}"
        if self.drafter == "suffix" and self.ngram_min > DEFAULT_MAX_MATCH:
            return f"ngram_min is the suffix drafter's shortest match; it must be <= {DEFAULT_MAX_MATCH}"
        if self.draft_vocab < 0:
            return f"--draft-vocab must be >= 0 (0 = full vocabulary); got {self.draft_vocab}"
        if self.draft_vocab and self.target_tokenizer:
            return "--draft-vocab and --target-tokenizer both cut the output head (the latter to the shared tokens)"
        return None


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> DraftConfig:
    return parse_settings(DraftConfig, "SPECDEC_DRAFT", argv, env, "python -m draft_service", "Draft service")
