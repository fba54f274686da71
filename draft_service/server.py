"""Draft gRPC server: build it from a config, serve until a signal."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, PreTrainedModel

from draft_service.config import DraftConfig, parse_config
from draft_service.eagle import EagleRunner
from draft_service.ngram import Lookup, NgramDrafter, PromptLookup
from draft_service.runner import DraftRunner
from draft_service.servicer import DraftServicer
from draft_service.suffix import SuffixLookup
from draft_service.vocab_bridge import VocabBridge
from specdec.engine import attention
from specdec.engine.calibration import calibrate_costs
from specdec.engine.eagle import load_head
from specdec.engine.modeling import (
    DTYPES,
    LoadedModel,
    check_device,
    frequent_token_ids,
    load_causal_lm,
    load_tokenizer_info,
    restrict_output_head,
)
from specdec.engine.pace import Pacer, load_profile
from specdec.engine.quantize import INT8_LABEL, quantize_int8
from specdec.rpc.model_thread import ModelThread
from specdec.rpc.security import load_server_security
from specdec.rpc.serving import RunningServer, leave_torch_to_the_model_thread, serve_forever, start_model_server
from specdec.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
R = TypeVar("R", bound=DraftRunner)


def load_runner(config: DraftConfig, **runner_options) -> DraftRunner | NgramDrafter:
    """`runner_options`: further `DraftRunner` keyword arguments that are no flags (tests set
    `proposal_mode` and `proposal_top_k` this way); the service passes none."""
    if problem := config.problem():
        raise ValueError(problem)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    if config.drafter == "ngram":
        if runner_options:
            raise ValueError(f"the ngram drafter runs no model: {sorted(runner_options)} do not apply")
        return NgramDrafter(
            load_tokenizer_info(config.model, config.trust_remote_code),
            max_sessions=config.max_sessions,
            session_ttl_s=config.session_ttl_s,
            max_speculative_tokens=config.max_speculative_tokens,
            min_n=config.ngram_min,
            max_n=config.ngram_max,
        )
    if config.drafter == "eagle":
        return _eagle_runner(config, runner_options)
    # The target's tokenizer first: a wrong folder fails in seconds, before the weights load.
    caller = None
    if config.target_tokenizer:
        try:
            caller = load_tokenizer_info(config.target_tokenizer, config.trust_remote_code)
        except (OSError, ValueError) as exc:
            problem = f"--target-tokenizer {config.target_tokenizer}: the tokenizer cannot be read: {exc}"
            raise ValueError(problem) from exc
    loaded = load_causal_lm(config.model, config.dtype, config.device, trust_remote_code=config.trust_remote_code)
    head_ids, bridge = None, None
    if caller is not None and caller.tokenizer_fingerprint == loaded.tokenizer_fingerprint:
        logger.info("--target-tokenizer %s is the draft's own tokenizer: no bridge needed", config.target_tokenizer)
    elif caller is not None:
        bridge = VocabBridge(loaded, caller)
        head_ids = bridge.draft_ids
        restrict_output_head(loaded.model, head_ids)
        figures = bridge.figures
        logger.info(
            "drafting for the tokenizer of %s: %d shared tokens, %.1f%% of its %d (%.1f%% of the draft's %d); "
            "the output head is cut to them",
            config.target_tokenizer,
            figures.shared_tokens,
            100 * figures.share,
            figures.caller_vocab_tokens,
            100 * figures.shared_tokens / loaded.vocab_size,
            loaded.vocab_size,
        )
    if config.draft_vocab:
        head_ids = frequent_token_ids(loaded.tokenizer, loaded.vocab_size, config.draft_vocab, loaded.eos_token_ids)
        restrict_output_head(loaded.model, head_ids)
        logger.info("draft output head restricted to %d of %d ids", len(head_ids), loaded.vocab_size)
    loaded = _quantized(config, loaded)
    runner = DraftRunner(
        loaded,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
        head_ids=head_ids,
        max_kv_bytes=config.max_kv_bytes,
        prefix_cache_bytes=config.prefix_cache_bytes,
        prefix_block_tokens=config.prefix_block_tokens,
        min_confidence=config.min_confidence,
        lookup=lookup_of(config),
        bridge=bridge,
        **runner_options,
    )
    runner.max_batch_size = config.max_batch_size
    return _paced_and_calibrated(config, runner)


def _eagle_runner(config: DraftConfig, runner_options: dict) -> EagleRunner:
    """--drafter eagle: the head of --draft-head over the embedding (and EAGLE-1's LM head) of
    the target in --model, whose tokenizer it speaks."""
    check_device(config.device)
    info = load_tokenizer_info(config.model, config.trust_remote_code)
    target_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    head = load_head(Path(config.draft_head), Path(config.model), target_config, DTYPES[config.dtype], config.device)
    loaded = LoadedModel(
        model=head.head,  # type: ignore[arg-type]  # the runners' causal-LM surface (specdec.engine.eagle)
        tokenizer=info.tokenizer,
        model_id=config.draft_head,
        device=config.device,
        device_label=config.device,
        vocab_size=int(target_config.vocab_size),
        eos_token_ids=info.eos_token_ids,
        max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
    )
    loaded = _quantized(config, loaded)
    logger.info(
        "%s head %s for %s: reads the target's hidden states %s; %d draft tokens",
        head.folder.kind,
        config.draft_head,
        config.model,
        list(head.feature_layers),
        head.head.lm_head.out_features,
    )
    runner = EagleRunner(
        loaded,
        head,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
        max_kv_bytes=config.max_kv_bytes,
        min_confidence=config.min_confidence,
        **runner_options,
    )
    runner.max_batch_size = config.max_batch_size
    return _paced_and_calibrated(config, runner)


def _quantized(config: DraftConfig, loaded: LoadedModel) -> LoadedModel:
    """--quantize: the model's Linear layers in int8 where it resolves to int8."""
    if config.resolved_quantize() != "int8":
        return loaded
    logger.info("draft Linear layers quantised to int8 (per-token activation scales)")
    return int8_on_cpu(loaded)


def int8_on_cpu(loaded: LoadedModel) -> LoadedModel:
    """The model with int8 Linear layers and, on CPU, attention row by row in short passes and
    padded batches (specdec.engine.attention.BATCHES): a padded batch's SDPA rounds otherwise
    as a lone pass does not, and the per-token int8 layers turn that rounding into whole
    quantisation steps, so a seeded request's proposals moved with other traffic (4 of 6
    concurrent seeded requests on the real pair). Each row of a batch then reads its own
    session's keys as its lone pass does: bitwise. A prompt longer than MAX_ROWS runs alone
    (draft_service.batched), under SDPA."""
    quantize_int8(loaded.model)
    if loaded.device == "cpu" and isinstance(loaded.model, PreTrainedModel):
        loaded.model.set_attn_implementation(attention.BATCHES)
    elif loaded.device == "cpu":  # an EAGLE head: its Llama layer reads its config's choice
        loaded.model.config._attn_implementation = attention.BATCHES
    return dataclasses.replace(loaded, quantization=INT8_LABEL)


def _paced_and_calibrated(config: DraftConfig, runner: R) -> R:
    """--pass-cost-profile (before calibration, which then measures the emulated passes) and
    --calibrate, for either model runner, after --cuda-graphs (so calibration times its passes)."""
    runner.use_static_passes(config.cuda_graphs)
    if config.pass_cost_profile:
        runner.pacer = Pacer(load_profile(config.pass_cost_profile))
    if config.calibrate:
        calibrate_costs(runner, keep_all_logits=False)
    return runner


def lookup_of(config: DraftConfig) -> Lookup | None:
    """Where a copying model drafter looks: its session (hybrid), earlier sessions too (suffix)."""
    if config.drafter == "hybrid":
        return PromptLookup(config.ngram_min, config.ngram_max)
    if config.drafter == "suffix":
        return SuffixLookup(config.suffix_cache_tokens, min_match=config.ngram_min)
    return None


async def build_server(
    config: DraftConfig, runner: DraftRunner | NgramDrafter | None = None, model_thread: ModelThread | None = None
) -> RunningServer:
    """Starts the server (loading the model unless a runner is given); `.port` is the bound port.
    `model_thread`: one its caller owns and may share (specdec.rpc.serving.start_model_server)."""
    # Before the weights load: a bad certificate or token file fails in seconds, not minutes.
    credentials, interceptors = load_server_security(config.security)
    return await start_model_server(
        config,
        runner,
        lambda: load_runner(config),
        DraftServicer,
        draft_pb2_grpc.add_DraftServicer_to_server,
        SERVICE_NAME,
        credentials,
        interceptors,
        model_thread,
    )


def main(argv: list[str] | None = None, pass_cost_profile: str = "") -> None:
    """`python -m draft_service`; `pass_cost_profile` emulates an accelerator (bench.emulated)."""
    config = dataclasses.replace(parse_config(argv), pass_cost_profile=pass_cost_profile)
    if pass_cost_profile and config.drafter == "ngram":
        raise SystemExit("an emulated pass cost needs a drafter with a model; the ngram drafter runs no pass")
    config = leave_torch_to_the_model_thread(config)
    asyncio.run(serve_forever(lambda: build_server(config), config.log_level, "specdec-draft", config.shutdown_grace_s))
