"""Timing a runner's own passes at start-up (the costs the coordinator's choosers read,
specdec.engine.costs): one session's passes over 1..K + 1 new tokens, and batched passes of
copies of it, on this process's hardware, dtype and threads."""

from __future__ import annotations

import logging

import torch

from specdec.engine.costs import CALIBRATION_CONTEXT, CALIBRATION_MAX_TOKENS, PassCosts, batch_grid, calibrate, fastest
from specdec.engine.kv import batchable_cache, cache_prefix
from specdec.engine.runner import ModelRunner
from specdec.engine.sessions import KVSession

logger = logging.getLogger(__name__)


def calibrate_costs(runner: ModelRunner, keep_all_logits: bool, context_tokens: int = CALIBRATION_CONTEXT) -> PassCosts:
    """Times passes over 1..max_speculative_tokens + 1 new tokens (at most
    CALIBRATION_MAX_TOKENS) on top of a cached context, on this process's own hardware, dtype
    and threads (see specdec.engine.costs).

    `keep_all_logits`: the target scores every new token (K + 1 logits); the draft only
    needs the last one. The scratch session lives outside the store and no counter moves.
    """
    context_tokens = max(1, min(context_tokens, runner.loaded.max_context - runner.max_speculative_tokens - 2))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, runner.loaded.vocab_size, (context_tokens + runner.max_speculative_tokens + 1,), generator=generator
    ).tolist()
    session = KVSession("calibration", cache=runner.new_cache())
    counters = ("processed_tokens_total", "batched_forwards", "batched_sessions_total", "max_batch_size_seen")
    before = {name: getattr(runner, name) for name in counters}  # the timed passes serve nobody
    with torch.inference_mode():
        runner._forward_admitted(session, ids[:context_tokens], logits_to_keep=1)

        def run_pass(n: int) -> None:
            runner._forward_admitted(
                session, ids[context_tokens : context_tokens + n], logits_to_keep=n if keep_all_logits else 1
            )
            runner._synchronize()
            session.model_cache().crop(-n)

        runner.pass_costs = None  # the timed passes are not live traffic
        costs = calibrate(run_pass, min(runner.max_speculative_tokens + 1, CALIBRATION_MAX_TOKENS))
        batch_ms = _calibrate_batches(runner, session, ids[context_tokens:], len(costs), keep_all_logits)
    for name, value in before.items():
        setattr(runner, name, value)
    runner.pass_costs = PassCosts(costs, context_tokens, batch_ms=batch_ms)
    logger.info(
        "forward pass cost over a %d-token context, by new tokens: %s",
        context_tokens,
        ", ".join(f"{n + 1}: {ms:.1f} ms" for n, ms in enumerate(costs)),
    )
    if batch_ms:
        logger.info(
            "batched pass cost, sessions x new tokens: %s",
            ", ".join(f"{b}x{n}: {ms:.1f} ms" for b, n, ms in batch_ms),
        )
    return runner.pass_costs


def _calibrate_batches(
    runner: ModelRunner, session: KVSession, new_ids: list[int], max_new_tokens: int, keep_all_logits: bool
) -> tuple[tuple[int, int, float], ...]:
    """Times batched passes (costs.batch_grid) of copies of the calibration session, each
    on the same cached context, as they are served (static passes under --cuda-graphs). None
    under tensor parallelism or for caches that cannot be batched: the coordinator then costs
    a batch as one pass over all its tokens."""
    if runner.max_batch_size < 2 or runner.loaded.tensor_parallel_size > 1 or not batchable_cache(session.cache):
        return ()
    timed = []
    for sessions, n in batch_grid(runner.max_batch_size, max_new_tokens):
        rows = [
            KVSession(f"calibration-{i}", cache=cache_prefix(session.model_cache(), session.cached_tokens))
            for i in range(sessions)
        ]

        def run_batch(rows=rows, n=n) -> None:
            keep = [n if keep_all_logits else 1] * len(rows)
            runner._pass_admitted(rows, list(range(len(rows))), [new_ids[:n]] * len(rows), keep, None)  # as served
            runner._synchronize()
            for row in rows:
                row.model_cache().crop(-n)

        run_batch()  # warm-up: the first pass of a new shape
        timed.append((sessions, n, fastest(run_batch)))

    return tuple(timed)
