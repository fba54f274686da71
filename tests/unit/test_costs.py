"""Measured pass costs: calibration on the runner's own passes, live averages, extrapolation."""

from __future__ import annotations

import pytest

from specdec.engine.costs import CALIBRATION_MAX_TOKENS, PassCosts, calibrate, cost_at
from specdec.sampling.probs import SamplingParams
from target_service import server as target_server
from target_service.config import TargetConfig
from target_service.runner import TargetRunner, VerifyCall
from tests.stack import model_service_config


def test_calibrate_times_every_size_keeps_the_fastest_run_and_times_slow_passes_once(monkeypatch):
    import specdec.engine.costs as costs_module

    now = [0.0]
    # Two warm-ups, then size 1 twice (5 ms, 3 ms), size 2 twice (7, 6), size 3 once (a 400 ms
    # pass is not repeated), size 4 twice (200, 150: cheaper than size 3 came out, so size 3
    # was disturbed and takes 150 too).
    durations = iter([1.0, 1.0, 5.0, 3.0, 7.0, 6.0, 400.0, 200.0, 150.0])
    calls: list[int] = []

    def run_pass(n: int) -> None:
        calls.append(n)
        now[0] += next(durations) / 1e3

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    measured = calibrate(run_pass, 4, repeats=2, warmup=2)
    assert calls == [1, 1, 1, 1, 2, 2, 3, 4, 4]
    assert measured == pytest.approx((3.0, 6.0, 150.0, 150.0))


def test_cost_at_extrapolates_past_the_measured_sizes():
    assert cost_at((10.0, 12.0, 14.0), 2) == 12.0
    assert cost_at((10.0, 12.0, 14.0), 5) == pytest.approx(18.0)
    assert cost_at((10.0,), 4) == 10.0


def test_live_costs_move_toward_observed_passes_and_ignore_other_sizes():
    costs = PassCosts((10.0, 20.0), context_tokens=128)
    costs.observe(1, 30.0)
    costs.observe(7, 1000.0)
    assert costs.calibrated_ms == (10.0, 20.0)
    assert costs.live_ms[0] == pytest.approx(12.0) and costs.live_ms[1] == 20.0


def test_runner_calibration_reports_costs_in_info_without_touching_sessions(tiny_pair):
    config = model_service_config(TargetConfig, tiny_pair.target, max_speculative_tokens=4, calibrate=True)
    runner = target_server.load_runner(config)
    info = runner.describe()
    assert len(info.calibrated_pass_ms) == 5 and all(ms > 0 for ms in info.calibrated_pass_ms)
    assert info.cost_context_tokens > 0 and info.live_pass_ms == info.calibrated_pass_ms
    assert runner.processed_tokens_total == 0 and len(runner.sessions) == 0
    # Batched passes of 2, 4 and 8 sessions (--max-batch-size 8) with 1 and K + 1 tokens each.
    assert info.max_batch_size == 8
    assert [(b, n) for b, n, _ in info.calibrated_batch_ms] == [(b, n) for b in (2, 4, 8) for n in (1, 5)]
    assert all(ms > 0 for _, _, ms in info.calibrated_batch_ms)
    # A live pass moves the live figure of its size only.
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    runner.verify_one(VerifyCall("s", 0, [1, 2, 3], [], None, greedy, 0))
    runner.verify_one(VerifyCall("s", 3, [4], [5], None, greedy, 0))
    after = runner.describe()
    assert after.calibrated_pass_ms == info.calibrated_pass_ms
    assert after.live_pass_ms[1] != info.live_pass_ms[1]  # the 2-token verify
    assert after.live_pass_ms[3:] == info.live_pass_ms[3:]


def test_calibration_is_capped_and_off_means_no_costs(tiny_pair):
    runner = target_server.load_runner(
        model_service_config(TargetConfig, tiny_pair.target, max_speculative_tokens=16, calibrate=True)
    )
    assert len(runner.describe().calibrated_pass_ms) == CALIBRATION_MAX_TOKENS
    plain = target_server.load_runner(model_service_config(TargetConfig, tiny_pair.target))
    assert plain.describe().calibrated_pass_ms == ()
    assert isinstance(plain, TargetRunner)
