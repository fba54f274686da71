"""Shared fixtures: tiny model pairs built once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Services the tests start as processes: no start-up calibration, unless a test's flags say
# otherwise (tests/heavy/test_readme_commands.py runs every default) ...
os.environ.setdefault("SPECDEC_TARGET_CALIBRATE", "off")
os.environ.setdefault("SPECDEC_DRAFT_CALIBRATE", "off")
# ... and drafts of exactly K (confidence stops have tests of their own).
os.environ.setdefault("SPECDEC_DRAFT_MIN_CONFIDENCE", "0")
# Services started as processes fork from one that imported torch and transformers once
# (specdec.tools.forkserver): nearly all of a model service's start-up is those imports.
os.environ.setdefault("SPECDEC_FORK_SERVICES", "1")
# The parallel tier's workers (pytest-xdist) share the machine's cores, three on two. Each
# would run torch with one intra-op thread per core, and OpenMP's idle threads spin after
# every op of the tiny models: they took cores from the other workers. One thread each, as
# the services the tests start get already (tests/stack.py): on this 2-core machine eleven
# χ² cases of test_distribution.py at -n 3 took 130 s instead of 180 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import settings
from transformers.utils import logging as hf_logging

from specdec.rpc.serving import freeze_start_up_objects
from specdec.tools.testing import (
    DRAFT_CORPUS,
    EOS,
    TinyPair,
    build_bridged_draft,
    build_pair,
    byte_level_tokenizer,
    word_tokenizer,
)

hf_logging.disable_progress_bar()

# Hypothesis example counts: `ci` (the default, what `make test` and CI run) keeps the fuzz
# tests' full 300 examples; HYPOTHESIS_PROFILE=dev runs 30 for a quick local loop.
settings.register_profile("ci", max_examples=300)
settings.register_profile("dev", max_examples=30)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    """Byte-level BPE text pair with EOS; the draft is a noisy copy of the target, so it agrees
    with the target's greedy choice about 60% of the time."""
    return build_pair(
        tmp_path_factory.mktemp("tiny"), byte_level_tokenizer(), logit_scale=3.0, noise=0.3, eos=True, max_context=256
    )


@pytest.fixture(scope="session")
def word_pair(tmp_path_factory) -> TinyPair:
    """A 12-token pair without EOS and with spread-out distributions, for exact
    distribution tests over whole sequences."""
    return build_pair(tmp_path_factory.mktemp("word"), word_tokenizer(12), logit_scale=1.5, noise=0.6, eos=False)


@pytest.fixture(scope="session")
def peaked_word_pair(tmp_path_factory) -> TinyPair:
    """A 12-token pair without EOS whose target is peaked (its likeliest 3-token continuations
    of a prompt hold nearly all the mass), for χ² tests with power over a few dozen cells."""
    return build_pair(tmp_path_factory.mktemp("peaked"), word_tokenizer(12), logit_scale=6.0, noise=0.6, eos=False)


@pytest.fixture(scope="session")
def peaked_bridged_pair(peaked_word_pair, tmp_path_factory) -> TinyPair:
    """peaked_word_pair's target with a draft of another vocabulary: w3..w11 in reverse order
    and two words of its own, so w0..w2 are the target's alone."""
    folder = tmp_path_factory.mktemp("peaked-bridged") / "draft"
    words = ["x0", *(f"w{i}" for i in range(11, 2, -1)), "x1"]
    build_bridged_draft(folder, word_tokenizer(len(words), words), peaked_word_pair.target, noise=0.6)
    return TinyPair(peaked_word_pair.target, folder, peaked_word_pair.vocab_size, None)


@pytest.fixture(scope="session")
def bridged_pair(tiny_pair, tmp_path_factory) -> TinyPair:
    """tiny_pair's target with a draft of another tokenizer (other merges, other ids, an extra
    special token), whose rows of shared tokens copy the target's: started with
    --target-tokenizer, it drafts within the tokens both vocabularies hold."""
    folder = tmp_path_factory.mktemp("bridged") / "draft"
    tokenizer = byte_level_tokenizer(300, DRAFT_CORPUS, ("<pad>", EOS))
    build_bridged_draft(folder, tokenizer, tiny_pair.target, noise=0.3)
    return TinyPair(tiny_pair.target, folder, tiny_pair.vocab_size, tiny_pair.eos_token_id)


@pytest.fixture(scope="module")
def target_runner(tiny_pair):
    """The tiny target's runner in float32, one per test module (its sessions are the module's)."""
    from specdec.engine.modeling import load_causal_lm
    from target_service.runner import TargetRunner

    return TargetRunner(
        load_causal_lm(str(tiny_pair.target), "float32", "cpu"),
        max_sessions=4,
        session_ttl_s=60,
        max_speculative_tokens=8,
    )


@pytest.fixture(scope="session")
def reference(tiny_pair):
    """Plain transformers greedy decoding with the tiny target in float32: the ground truth
    for greedy identity. `reference(prompt, max_new_tokens)` → generated ids (cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair.target)
    cache: dict[tuple[str, int], list[int]] = {}

    def generate(prompt: str, max_new_tokens: int = 40) -> list[int]:
        if (prompt, max_new_tokens) not in cache:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            cache[prompt, max_new_tokens] = out[0, ids.shape[1] :].tolist()
        return cache[prompt, max_new_tokens]

    return generate


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A CA, server and client certificates, a rogue CA and token files (tests/certs.py)."""
    from tests.certs import issue

    return issue(tmp_path_factory.mktemp("tls"))


def pytest_collection_finish(session) -> None:
    """Every test module is imported: torch, transformers and the project hold several hundred
    thousand objects that live as long as the worker. Each full collection scanned them all
    again (a sixth of a table-services χ² run's time went to the collector); frozen, no
    collection looks at them, and what the tests allocate is collected as before. The
    services do the same after start-up (specdec.rpc.serving.freeze_start_up_objects)."""
    freeze_start_up_objects()
