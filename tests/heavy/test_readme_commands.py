"""The three services started exactly as README.md's "Running the services yourself" gives
their commands, on a tiny float32 pair: no other flag and no SPECDEC_* variable, so every
default is the one a new user gets. (`--port` takes a free port instead of README's, and
`--metrics-port 0` keeps the Prometheus port clear of other tests; neither changes an output.)

Greedy output must equal transformers' own `generate()` on the target, and sampled output must
have the target's exact distribution (χ², with a power check). Issue 39: the target once
quantised the float32 model it was given to int8 by default, and these failed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from specdec.rpc.ports import free_port
from specdec.sampling.probs import SamplingParams
from specdec.tools.launch import ServiceProcess, spawn, stop_all
from specdec.tools.testing import TinyPair
from specdec.v1 import common_pb2, coordinator_pb2_grpc, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.heavy.test_distribution import PROMPT, SAMPLES, exact_target_distribution
from tests.stats import P_VALUE_FLOOR, chi_square_p_value

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("draft_service", "target_service", "coordinator")
GREEDY_PROMPTS = ("def add(a, b):", "The quick brown fox", "SELECT name, count(*) FROM", "import numpy as", "Once upon")


def readme_commands() -> dict[str, list[str]]:
    """The argument lists README.md gives each service under "Running the services yourself"."""
    section = (ROOT / "README.md").read_text().split("## Running the services yourself", 1)[1]
    block = section.split("```", 2)[1]
    commands = {}
    for line in block.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if words[:2] == ["python", "-m"] and words[2] in MODULES:
            commands[words[2]] = words[3:]
    assert set(commands) == set(MODULES), f"README.md's commands changed shape: {block}"
    return commands


def as_run_here(args: list[str], values: dict[str, str]) -> list[str]:
    """README's arguments with its placeholders filled in and its --port taken out (spawn
    passes a free one); the placeholders' names are README's."""
    filled = [re.sub(r"[A-Z_]+_FOLDER|HOST_[AB]:\d+", lambda m: values[m.group(0)], word) for word in args]
    port_at = filled.index("--port")
    return filled[:port_at] + filled[port_at + 2 :]


@contextmanager
def started_as_readme_says(pair: TinyPair, logs: Path) -> Iterator[dict[str, ServiceProcess]]:
    # Every SPECDEC_* variable the test session set (tests/conftest.py) is left out: defaults only.
    env: dict[str, str | None] = {name: None for name in os.environ if name.startswith("SPECDEC_")}
    commands = readme_commands()
    ports = {module: free_port() for module in MODULES}
    values = {
        "DRAFT_FOLDER": str(pair.draft),
        "TARGET_FOLDER": str(pair.target),
        "HOST_A:50061": f"127.0.0.1:{ports['draft_service']}",
        "HOST_B:50062": f"127.0.0.1:{ports['target_service']}",
    }
    started: list[ServiceProcess] = []
    try:
        for module in MODULES:
            args = as_run_here(commands[module], values)
            process = spawn(module, module, args, ports[module], logs / f"{module}.log", env, ROOT)
            started.append(process)
            process.wait_healthy(120)
        yield {process.name: process for process in started}
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def text_stack(tiny_pair, tmp_path_factory):
    """The byte-level text pair: greedy identity on text prompts."""
    with started_as_readme_says(tiny_pair, tmp_path_factory.mktemp("readme-text")) as services:
        yield services


@pytest.fixture(scope="module")
def word_stack(word_pair, tmp_path_factory):
    """The 12-token pair: the exact distribution over 3-token continuations, by enumeration."""
    with started_as_readme_says(word_pair, tmp_path_factory.mktemp("readme-word")) as services:
        yield services


def test_the_target_serves_the_model_as_given(text_stack):
    with grpc.insecure_channel(text_stack["target_service"].address) as channel:
        info = target_pb2_grpc.TargetStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    assert info.dtype == "float32" and info.quantization == "", (info.dtype, info.quantization)


def test_greedy_output_is_the_targets_own(text_stack, reference):
    with grpc.insecure_channel(text_stack["coordinator"].address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        diverged = []
        for prompt in GREEDY_PROMPTS:
            for k in (None, 1, 3, 5):  # None: the K chooser, as a request that leaves K unset gets
                response = stub.Generate(
                    pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=k), timeout=60
                )
                if list(response.token_ids) != reference(prompt, 40):
                    diverged.append((prompt, k))
    assert not diverged, f"greedy output differs from transformers' generate() on the target for {diverged}"
    assert response.stats.target_numerics == "float32"


async def sample(address: str, params: SamplingParams, seeds, k: int | None) -> tuple[list, list]:
    semaphore = asyncio.Semaphore(16)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        async def one(seed: int):
            async with semaphore:
                return await stub.Generate(
                    pb.GenerateRequest(
                        prompt_token_ids=PROMPT, max_new_tokens=3, num_speculative_tokens=k, temperature=1.0, seed=seed
                    ),
                    timeout=60,
                )

        responses = await asyncio.gather(*(one(seed) for seed in seeds))
    return [tuple(r.token_ids) for r in responses], [r.stats for r in responses]


async def test_sampled_output_has_the_targets_distribution(word_stack, word_pair):
    params = SamplingParams(temperature=1.0)
    target = exact_target_distribution(word_pair.target, params, word_pair.vocab_size)
    samples, stats = await sample(word_stack["coordinator"].address, params, range(SAMPLES), k=2)
    assert sum(s.accepted_tokens for s in stats) > SAMPLES // 4, "drafts were rarely accepted; nothing was tested"
    assert not {seq for seq, p in target.items() if p == 0.0}.intersection(samples)
    p_value = chi_square_p_value(samples, target)
    assert p_value > P_VALUE_FLOOR, f"χ² p-value {p_value:.2e}: the output is not the target's distribution"
    # Power check: the same samples are told apart from the draft model's distribution.
    draft = exact_target_distribution(word_pair.draft, params, word_pair.vocab_size)
    assert chi_square_p_value(samples, draft) < 1e-6, "the test cannot tell the target from the draft"
