"""Shared fixtures: tiny model pairs built once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Services the tests start as processes: no start-up calibration, unless a test's flags say
# otherwise (tests/integration/test_readme_commands.py runs every default) ...
os.environ.setdefault("SPECDEC_TARGET_CALIBRATE", "off")
os.environ.setdefault("SPECDEC_DRAFT_CALIBRATE", "off")
# ... and drafts of exactly K (confidence stops have tests of their own).
os.environ.setdefault("SPECDEC_DRAFT_MIN_CONFIDENCE", "0")

import pytest
from hypothesis import settings
from transformers.utils import logging as hf_logging

from specdec.tools.testing import TinyPair, build_pair, byte_level_tokenizer, word_tokenizer

hf_logging.disable_progress_bar()

# Hypothesis example counts: `ci` (the default, what `make test` and CI run) keeps the fuzz
# tests' full 300 examples; HYPOTHESIS_PROFILE=dev runs 30 for a quick local loop.
settings.register_profile("ci", max_examples=300)
settings.register_profile("dev", max_examples=30)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The full suite (`make test`, what CI runs) runs everything. `make test-fast` skips the
# modules below, which start processes, run benchmarks or sample thousands of generations
# over gRPC; what it keeps (the sampling math and its χ² tests, the runners, and the three
# services in process: greedy identity in every mode and drafter, errors, batching) runs in
# about 3 minutes on 2 cores.
HEAVY_MODULES = {
    "integration/test_distribution.py": "3,000 seeded generations per case over gRPC",
    "integration/test_vocab_widths.py": "3,000 seeded generations per pair of widths",
    "integration/test_mode_distributions.py": "30,000-40,000 seeded generations per coordinator mode",
    "integration/test_bench_smoke.py": "every benchmark suite end to end, with processes",
    "integration/test_faults.py": "killed and restarted processes",
    "integration/test_tensor_parallel.py": "gloo ranks as processes",
    "integration/test_observability.py": "traces across processes",
    "integration/test_loadtest.py": "15 s of load",
    "integration/test_k_chooser.py": "calibrated services settling over many rounds",
    "integration/test_processes.py": "services as processes",
    "integration/test_fuzz_public_api.py": "hundreds of hypothesis examples over gRPC",
    "integration/test_real_pair.py": "the real Qwen pair",
    "integration/test_openai_api.py": "the services as processes, driven over HTTP by the openai client",
    "integration/test_readme_commands.py": "the services as processes, started by README's commands",
    "integration/test_hostile_clients.py": "the services as processes, flooded with 40 MB requests",
    "integration/test_pass_cost_profile.py": "emulated passes timed against a busy core; a service process",
    "unit/test_tensor_parallel_ranks.py": "gloo ranks as processes",
    "unit/test_tree_sampling.py": "40,000 simulated tree generations",
}


# `make test` runs the suite in two parts: everything else three tests at a time (pytest-xdist;
# three workers on two cores, since many tests wait on processes or sleeps part of the time,
# and those tests check results, not time), then these modules one test at a time, because
# they check deadlines or measured times that a test beside them would stretch: a killed node
# noticed within its deadline, a cancelled request freeing its sessions within a second, the
# K chooser settling from pass times the services measure on themselves.
SERIAL_MODULES = {
    "integration/test_faults.py": "deadlines after killing and restarting processes",
    "integration/test_processes.py": "services as processes, with deadlines",
    "integration/test_k_chooser.py": "start-up calibration measures pass times (contention moved it once)",
    "integration/test_real_pair.py": "the real Qwen pair: memory and time",
    "integration/test_hostile_clients.py": "a stream's largest gap between chunks while others are refused",
    "integration/test_pass_cost_profile.py": "passes timed to the profile's ms while another core is busy",
}


def module_of(item) -> str:
    return os.path.relpath(str(item.path), os.path.dirname(__file__)).replace(os.sep, "/")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        relative = module_of(item)
        if relative in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)
        if relative in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


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
