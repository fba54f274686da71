"""specdec.sampling.together: the calls of one batched pass concluded at once give each call
what `verify_outputs` (or, greedy, the argmax) gives it alone, and a NaN draws nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.sampling.probs import SamplingParams, biased, logits_to_probs, verify_outputs
from specdec.sampling.together import together_pays, verify_outputs_together

V = 64
SETTINGS = {
    "greedy": SamplingParams(),
    "greedy_logit_bias": SamplingParams(logit_bias=((3, 5.0), (7, -100.0))),
    "sampled": SamplingParams(temperature=0.8),
    "top_k_top_p_bias": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, logit_bias=((5, 2.0),)),
}


def calls(counts: list[int], seed: int = 0):
    """Each call's logits [K + 1, V] (peaked, so draws spread over a few tokens), draft rows
    [K, V], draft ids [K] and seed."""
    generator = torch.Generator().manual_seed(seed)
    logits = [3.0 * torch.randn(k + 1, V, generator=generator) for k in counts]
    drafts = [torch.softmax(2.0 * torch.randn(k, V, generator=generator), dim=-1) for k in counts]
    ids = [
        torch.multinomial(rows, 1, generator=generator).squeeze(-1).tolist() if k else []
        for rows, k in zip(drafts, counts)
    ]
    return logits, drafts, ids, [1000 + call for call in range(len(counts))]


def alone(params: SamplingParams, logits, drafts, ids, seed):
    """What the target's `_conclude` draws for one call."""
    scored = biased(logits, params)
    k = len(ids)
    if params.greedy:
        argmax = scored.argmax(dim=-1)
        return (torch.tensor(ids) == argmax[:k]).float().tolist(), argmax[:k].tolist(), int(argmax[k])
    drawn = verify_outputs(logits_to_probs(scored, params), drafts, torch.tensor(ids, dtype=torch.int64),
                           np.random.default_rng(seed))  # fmt: skip
    return drawn.draft_token_target_probs.tolist(), drawn.recovered_token_ids.tolist(), drawn.bonus_token_id


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_call_gets_what_it_draws_alone(name):
    params = SETTINGS[name]
    counts = [4, 0, 1, 6, 4, 2] * 8  # target-only steps (K = 0) among rounds of several lengths
    logits, drafts, ids, seeds = calls(counts)
    together = verify_outputs_together(params, torch.cat(logits), torch.cat(drafts), ids, seeds)
    assert together is not None and len(together) == len(counts)
    for call, got in enumerate(together):
        want = alone(params, logits[call], drafts[call], ids[call], seeds[call])
        assert (got.draft_token_target_probs.tolist(), got.recovered_token_ids.tolist(), got.bonus_token_id) == want
    if not params.greedy:  # the draws are the seeds' own: other seeds draw otherwise
        shifted = verify_outputs_together(params, torch.cat(logits), torch.cat(drafts), ids, [s + 1 for s in seeds])
        assert shifted is not None
        assert [o.recovered_token_ids.tolist() for o in shifted] != [o.recovered_token_ids.tolist() for o in together]


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_target_only_steps_alone_in_a_group_are_concluded_together(name):
    """Calls with no drafts (K = 0: concurrent target-only steps) draw only their bonus."""
    params = SETTINGS[name]
    logits, drafts, ids, seeds = calls([0] * 5)
    together = verify_outputs_together(params, torch.cat(logits), torch.cat(drafts), ids, seeds)
    assert together is not None
    for call, got in enumerate(together):
        want = alone(params, logits[call], drafts[call], ids[call], seeds[call])
        assert (got.draft_token_target_probs.tolist(), got.recovered_token_ids.tolist(), got.bonus_token_id) == want


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_a_nan_logit_draws_nothing(name):
    logits, drafts, ids, seeds = calls([2, 3])
    logits[1][0, 5] = float("nan")
    assert verify_outputs_together(SETTINGS[name], torch.cat(logits), torch.cat(drafts), ids, seeds) is None


def test_on_a_cpu_only_small_rows_are_concluded_together():
    small, large = [torch.zeros(5, 320)] * 16, [torch.zeros(5, 151_936)] * 2
    assert together_pays(small) and not together_pays(large) and not together_pays(small[:1])
