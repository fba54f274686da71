"""Loading the target model into a runner: shared by the server (rank 0) and the
tensor-parallel ranks it spawns, so neither module has to import the other."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from specdec.engine import attention
from specdec.engine.calibration import calibrate_costs
from specdec.engine.modeling import load_causal_lm
from specdec.engine.pace import Pacer, load_profile
from specdec.engine.quantize import INT8_LABEL, quantize_int8
from target_service import tensor_parallel
from target_service.config import TargetConfig
from target_service.runner import TargetRunner

logger = logging.getLogger(__name__)


def load_runner(config: TargetConfig) -> TargetRunner:
    """Under --tensor-parallel, this rank's shard (the process group must be up)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = config.device
    if config.tensor_parallel > 1:
        device = tensor_parallel.rank_device(config.device, int(os.environ.get("LOCAL_RANK", 0)))
    loaded = load_causal_lm(
        config.model, config.dtype, device, config.device_map, config.trust_remote_code, config.tensor_parallel
    )
    if config.resolved_quantize() == "int8":
        # The output is then the int8 model's distribution, not the float32 model's (docs/design.md: Exactness).
        quantize_int8(loaded.model)
        loaded = dataclasses.replace(loaded, quantization=INT8_LABEL)
        logger.info("target Linear layers quantised to int8 (per-token activation scales)")
    if loaded.device == "cpu" and config.tensor_parallel == 1 and not config.device_map:
        # Per-row attention: a token's logits are the same in a verify pass as in a one-token
        # pass (specdec.engine.attention); on a GPU, a Python loop over rows would cost more than it saves.
        # With int8's per-token Linear layers, prefills too: every solo pass is then per-token
        # exact, so a token's entries and logits depend on the tokens before it alone. A prefix
        # cache hit, a re-prefill after an eviction or a replica failover, and an uninterrupted
        # run then give bitwise the same output (docs/design.md, "An int8 target").
        every_row = bool(loaded.quantization)
        loaded.model.set_attn_implementation(attention.EVERY_ROW if every_row else attention.NAME)
    runner = TargetRunner(
        loaded,
        max_sessions=config.max_sessions,
        session_ttl_s=config.session_ttl_s,
        max_speculative_tokens=config.max_speculative_tokens,
        max_kv_bytes=config.max_kv_bytes,
        prefix_cache_bytes=config.prefix_cache_bytes,
        prefix_block_tokens=config.prefix_block_tokens,
    )
    runner.max_batch_size = config.max_batch_size
    runner.use_static_passes(config.cuda_graphs)  # before calibration, which then times its passes
    if config.pass_cost_profile:  # before calibration, which then measures the emulated passes
        runner.pacer = Pacer(load_profile(config.pass_cost_profile))
    if config.calibrate:
        # Under --tensor-parallel every rank runs this, so the passes' collectives line up.
        calibrate_costs(runner, keep_all_logits=True)
    return runner
