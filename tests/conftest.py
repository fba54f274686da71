"""Shared fixtures: tiny model pairs built once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from transformers.utils import logging as hf_logging

from tests.tiny_models import TinyPair, build_pair, byte_level_tokenizer, word_tokenizer

hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    """Byte-level BPE text pair with EOS; the draft is a noisy copy of the target, so it agrees
    with the target's greedy choice about 60% of the time."""
    return build_pair(tmp_path_factory.mktemp("tiny"), byte_level_tokenizer(), logit_scale=3.0, noise=0.3, eos=True, max_context=256)


@pytest.fixture(scope="session")
def word_pair(tmp_path_factory) -> TinyPair:
    """A 12-token pair without EOS and with spread-out distributions, for exact
    distribution tests over whole sequences."""
    return build_pair(tmp_path_factory.mktemp("word"), word_tokenizer(12), logit_scale=1.5, noise=0.6, eos=False)
