"""The target's side of rejection sampling for the calls of one batched pass at once: a few
tensor ops and one transfer from the device for all of them, where each call alone takes a few
of each (`probs.verify_outputs`; on a GPU every one of them a kernel launch or a wait). A
draft's decode batch draws its rows the same way (draft_service/batched.py, `step_together`).
Pure functions, no I/O."""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.sampling.probs import (
    SamplingParams,
    VerifyOutputs,
    argmax_outputs,
    biased,
    fetched_outputs,
    logits_to_probs,
    residual_probs,
    row_argmax,
    sample,
)
from specdec.sampling.transfer import fetch, to_device

# On a CPU, calls are concluded together only while their rows hold at most this many values
# (`together_pays`).
CPU_TOGETHER_VALUES = 1 << 18


def together_pays(logits: list[torch.Tensor]) -> bool:
    """Whether calls with these logits (each call's rows, [..., V]) are better drawn together than
    alone: on a GPU always, saving launches and waits; on a CPU only while their rows are
    small, since a call's own rows stay in cache where a batch's do not (16 calls of 5 rows
    over Qwen's 151,936 ids drew in 162 ms together against 28-62 ms alone, over 320 ids in
    0.8 against 2.8 ms; 2-core AMD EPYC)."""
    if len(logits) < 2:
        return False
    return logits[0].device.type != "cpu" or sum(rows.numel() for rows in logits) <= CPU_TOGETHER_VALUES


def verify_outputs_together(
    params: SamplingParams,
    logits: torch.Tensor,  # [R, V]: each call's K_c + 1 rows in turn, R = Σ (K_c + 1)
    draft_probs: torch.Tensor,  # [Σ K_c, V]: the calls' draft rows in turn (unused when greedy)
    draft_token_ids: list[list[int]],  # [C][K_c]
    seeds: list[int],  # [C]: each call's own
) -> list[VerifyOutputs] | None:
    """What `verify_outputs` (or, greedy, the target's argmax) gives each of C calls with the
    same sampling settings and no penalties, alone: the same rows, and each call's generator
    drawing its K_c recovered tokens, then its bonus, in that order (`sample` with a generator
    per row). None where a logit is NaN or infinite (-inf too, a masked id, which a call
    alone takes): each call is then concluded alone, and its own check names a NaN. One sum
    over several calls' rows may round apart from one call's (a row summed alone may be split
    over threads), which moves a residual's mass in its last bit, not its distribution."""
    counts = [len(ids) for ids in draft_token_ids]  # [C]
    ends = np.cumsum([k + 1 for k in counts])  # [C]: where each call's rows end
    device = logits.device
    scored = biased(logits, params)  # [R, V]
    total = logits.sum()  # [] finite unless some logit is not
    if params.greedy:
        finite, heads = fetch(total, row_argmax(scored))  # [1], [R]
        if not math.isfinite(finite[0]):
            return None
        outputs = []
        for end, k, call_ids in zip(ends, counts, draft_token_ids):
            argmax = torch.tensor([int(token) for token in heads[end - k - 1 : end]], dtype=torch.int64)  # [K + 1]
            outputs.append(argmax_outputs(argmax, torch.tensor(call_ids, dtype=torch.int64)))
        return outputs
    # The draws come from generators made from the seeds here, so a group with a NaN is
    # drawn and thrown away (sample() keeps ids in range), the finiteness read in the same
    # transfer as the outputs: one wait for the device.
    probs = logits_to_probs(scored, params)  # [R, V]
    bonus_rows = to_device(torch.as_tensor(ends - 1, dtype=torch.int64), device)  # [C]
    draft_rows = torch.tensor(
        [row for end, k in zip(ends, counts) for row in range(end - k - 1, end - 1)], dtype=torch.int64
    )  # [Σ K]: empty where every call is a target-only step
    ids = torch.tensor([token for call in draft_token_ids for token in call], dtype=torch.int64)  # [Σ K]
    ids = to_device(ids, device)  # [Σ K]
    drafted_probs = probs.index_select(0, to_device(draft_rows, device))  # [Σ K, V]
    token_probs = drafted_probs.gather(-1, ids[:, None]).squeeze(-1)  # [Σ K]
    generators = [np.random.default_rng(seed) for seed in seeds]
    row_generators = [generator for generator, k in zip(generators, counts) for _ in range(k)]
    recovered = (
        sample(residual_probs(drafted_probs, to_device(draft_probs, device)), row_generators) if row_generators else ids
    )  # [Σ K]
    bonus = sample(probs.index_select(0, bonus_rows), generators)  # [C], each after its call's K
    finite, fetched_probs, fetched_recovered, fetched_bonus = fetch(total, token_probs, recovered, bonus)
    if not math.isfinite(finite[0]):
        return None
    outputs = []
    for call, (end, k) in enumerate(zip(ends, counts)):
        part = slice(int(end) - k - 1 - call, int(end) - 1 - call)  # the call's draft rows among Σ K
        outputs.append(fetched_outputs(fetched_probs[part], fetched_recovered[part], fetched_bonus[call]))
    return outputs
