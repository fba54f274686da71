"""`python -m bench.emulated --pass-cost-profile`: a model service stands in for an accelerator. Every pass of the real
(tiny) model is held to the profile's time, sleeping, so it takes that time even while the
other core is busy; start-up calibration measures the emulated costs; Info names the profile;
a malformed profile stops the service at start-up naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.engine.pace import load_profile
from target_service import server as target_server
from target_service.config import TargetConfig
from tests.stack import model_service_config

ROOT = Path(__file__).resolve().parents[2]
# Slow enough that the tiny model's real compute (about a millisecond) is a small part of it.
PROFILE = {"name": "slow-card", "source": "a test", "pass_ms": [[1, 60.0], [16, 75.0], [64, 120.0]],
           "context_ms_per_1k": 5.0}  # fmt: skip
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "slow-card.json"
    path.write_text(json.dumps(PROFILE))
    return path


@pytest.fixture
def busy_core():
    """The other core kept busy, as a neighbour service or a benchmark would keep it. The model
    runs one torch thread, as an emulated service beside a busy neighbour should: with two, an
    OpenMP team waits on the busy core and the real compute overruns the profile."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    time.sleep(0.2)
    yield
    torch.set_num_threads(threads)
    spinner.kill()
    spinner.wait()


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def least_late(run, expected, times: int = 3) -> float:
    """The smallest of `times` runs' time over its expected time (`expected()` is read before
    each run, as each adds to the session's context). A loaded 2-core host only ever makes a
    pass late (a sleeper woken a few ms after its deadline while a neighbour holds the core);
    a pacer that holds a pass short or long makes every run so, and the least late shows it."""
    ratios = []
    for _ in range(times):
        ms = expected()
        ratios.append(timed(run) / ms)
    return min(ratios)


def test_passes_take_the_profiles_time_while_the_other_core_is_busy(tiny_pair, profile_file, busy_core):
    profile = load_profile(str(profile_file))
    config = model_service_config(
        TargetConfig, tiny_pair.target, pass_cost_profile=str(profile_file), calibrate=True, threads=1
    )
    runner = target_server.load_runner(config)
    # Calibration saw the emulated passes: 1..K+1 new tokens over its 128-token context.
    calibrated = runner.pass_costs.calibrated_ms
    for n, ms in enumerate(calibrated, start=1):
        assert ms == pytest.approx(profile.ms(n, runner.pass_costs.context_tokens), rel=TOLERANCE), n
    first, second = runner.sessions.open("a", 0), runner.sessions.open("b", 0)
    cases = [
        ("a 40-token prefill", lambda: runner.forward(first, list(range(40)), 1), 40),
        ("a decode step", lambda: runner.forward(first, [7], 1), 1),
        ("an 8-token verify", lambda: runner.forward(first, list(range(8)), 8), 8),
    ]
    for what, run, tokens in cases:
        ratio = least_late(run, lambda: profile.ms(tokens, first.cached_tokens))  # noqa: B023 (read at once)
        assert ratio == pytest.approx(1.0, rel=TOLERANCE), (what, runner.pacer.overruns, runner.pacer.worst_overrun_ms)
    runner.forward(second, list(range(10)), 1)
    # A batched pass over both sessions costs the profile at their tokens summed.
    batched = least_late(
        lambda: runner.forward_batch([first, second], [[1, 2, 3], [4, 5, 6]], [3, 3]),
        lambda: profile.ms(6, first.cached_tokens + second.cached_tokens),
    )
    assert batched == pytest.approx(1.0, rel=TOLERANCE)
    description = runner.describe()
    assert description.pass_cost_profile == "slow-card" and description.emulation_overruns == 0
    assert runner.pacer is not None and runner.pacer.passes >= 12 + len(calibrated)


def test_a_malformed_profile_stops_the_service_at_start_up_naming_the_field(tiny_pair, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PROFILE, "pass_ms": [[4, 10.0], [2, 20.0]]}))
    result = subprocess.run(
        [sys.executable, "-m", "bench.emulated", "--service", "target", "--model", str(tiny_pair.target),
         "--port", "0", "--pass-cost-profile", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--pass-cost-profile" in result.stderr and "pass_ms[1]: token counts must increase" in result.stderr
