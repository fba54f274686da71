"""Which K a request runs at: its own, the coordinator's fixed --num-speculative-tokens, or
the K chooser's (`--num-speculative-tokens auto`, the default)."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.config import FALLBACK_K, CoordinatorConfig
from coordinator.requests import GenerationRequest, prepare_job
from specdec.tools.testing import byte_level_tokenizer
from tests.unit.test_rounds import PAIR

CONFIG = CoordinatorConfig(draft_address="d:1", target_address="t:1", tokenizer="t")


@pytest.mark.parametrize(
    "configured, asked, pair_k, expected, chosen",
    [
        (None, None, 8, FALLBACK_K, True),  # auto: the chooser's, from FALLBACK_K where it has no costs
        (None, None, 2, 2, True),  # ... within what both services accept
        (None, 3, 8, 3, False),  # a request that sets K gets it
        (None, 0, 8, 0, False),
        (6, None, 8, 6, False),  # a fixed --num-speculative-tokens: every request leaving K unset, no chooser
        (6, None, 5, 5, False),
        (6, 2, 8, 2, False),
    ],
)
def test_k_is_the_requests_the_configured_or_the_choosers(configured, asked, pair_k, expected, chosen):
    config = dataclasses.replace(CONFIG, default_num_speculative_tokens=configured)
    pair = dataclasses.replace(PAIR, max_num_speculative_tokens=pair_k)
    request = GenerationRequest(prompt_token_ids=[65, 66], max_new_tokens=8, num_speculative_tokens=asked)
    job = prepare_job(request, config, pair, byte_level_tokenizer())
    assert (job.num_speculative_tokens, job.num_speculative_tokens_unset) == (expected, chosen)
