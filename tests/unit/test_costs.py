"""Measured pass costs: calibration on the runner's own passes, live averages, extrapolation."""

from __future__ import annotations

import pytest

from specdec.engine.costs import (
    CALIBRATION_MAX_TOKENS,
    LIVE_MIN_PASSES,
    LIVE_WINDOW,
    PassCosts,
    calibrate,
    cost_at,
    settled,
)
from specdec.sampling.probs import SamplingParams
from target_service import server as target_server
from target_service.config import TargetConfig
from target_service.runner import TargetRunner, VerifyCall
from tests.stack import model_service_config


def test_calibrate_sweeps_every_size_keeps_the_quick_end_and_times_slow_passes_once(monkeypatch):
    import specdec.engine.costs as costs_module

    now = [0.0]
    # Two warm-ups, and one of each other size; a sweep up (sizes 1-4: 5, 7, 400, 200 ms); a
    # sweep down (4, 2, 1: 150, 6, 3; size 3's 400 ms pass is not repeated); a sweep up again
    # (1, 2, 4: 4, 8, 160). The quick end of three runs is the fastest: 3, 6, 400, 150; size 3
    # came out dearer than size 4, so it was disturbed and takes 150.
    durations = iter([1.0, 1.0, 1.0, 1.0, 1.0, 5.0, 7.0, 400.0, 200.0, 150.0, 6.0, 3.0, 4.0, 8.0, 160.0])
    calls: list[int] = []

    def run_pass(n: int) -> None:
        calls.append(n)
        now[0] += next(durations) / 1e3

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    measured = calibrate(run_pass, 4, sweeps=3, warmup=2)
    assert calls == [1, 1, 2, 3, 4, 1, 2, 3, 4, 4, 2, 1, 1, 2, 4]
    assert measured == pytest.approx((3.0, 6.0, 150.0, 150.0))


def test_settled_is_the_lower_quartile_so_bursts_that_slow_a_few_passes_do_not_count():
    # Twelve runs of one size, a third of them in a burst that slowed them 40%.
    assert settled([50.0, 70.0, 51.0, 70.0, 52.0, 70.0, 53.0, 70.0, 54.0, 55.0, 56.0, 57.0]) == 52.0
    assert settled([50.0, 70.0, 60.0]) == 50.0 and settled([42.0]) == 42.0


def test_calibration_spreads_a_machine_slowing_down_over_every_size(monkeypatch):
    """Every pass costs 40 ms plus 1 ms for each pass run before it: a VM slowing down by
    108 ms over the calibration. Timed size by size, that drift reads as a curve rising 12 ms
    a token; swept up and down, the sizes end within 8 ms of each other."""
    import specdec.engine.costs as costs_module

    now, runs = [0.0], [0]

    def run_pass(n: int) -> None:
        now[0] += (40.0 + runs[0]) / 1e3
        runs[0] += 1

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    measured = calibrate(run_pass, 9, warmup=0)
    assert runs[0] == 12 * 9
    assert max(measured) - min(measured) == pytest.approx(8.0)


def test_cost_at_extrapolates_past_the_measured_sizes():
    assert cost_at((10.0, 12.0, 14.0), 2) == 12.0
    assert cost_at((10.0, 12.0, 14.0), 5) == pytest.approx(18.0)
    assert cost_at((10.0,), 4) == 10.0


def test_live_costs_settle_a_sizes_recent_passes_once_there_are_enough():
    costs = PassCosts((10.0, 20.0, 30.0), context_tokens=128)
    for _ in range(LIVE_MIN_PASSES - 1):
        costs.observe(1, 30.0)
    costs.observe(7, 1000.0)  # outside the calibrated sizes: ignored
    assert costs.live_ms == (10.0, 20.0, 30.0)  # too few passes yet: the calibrated figures
    costs.observe(1, 30.0)
    # The machine slowed: one token now costs 3x its calibrated figure, and the sizes not yet
    # served are taken to have slowed alike.
    assert costs.live_ms == pytest.approx((30.0, 60.0, 90.0))
    assert costs.calibrated_ms == (10.0, 20.0, 30.0)
    # A burst slows a third of the passes: the lower quartile keeps the pass's own cost, and
    # the size past the last one served follows that one.
    for ms in [14.0, 15.0, 90.0] * (LIVE_WINDOW // 3 + 1):
        costs.observe(2, ms)
    assert costs.live_ms == pytest.approx((30.0, 14.0, 21.0))
    # The window forgets: after LIVE_WINDOW passes in a faster state, only those count.
    for _ in range(LIVE_WINDOW):
        costs.observe(1, 12.0)
    assert costs.live_ms[0] == 12.0


def test_a_size_between_served_ones_moves_as_they_did_in_proportion():
    costs = PassCosts((10.0, 20.0, 30.0, 40.0, 50.0), context_tokens=128)
    for _ in range(LIVE_MIN_PASSES):
        costs.observe(1, 20.0)  # 2x
        costs.observe(5, 25.0)  # 0.5x
    # Sizes 2-4 lie between: their ratios run from 2 down to 0.5 in steps of 0.375.
    assert costs.live_ms == pytest.approx((20.0, 20.0 * 1.625, 30.0 * 1.25, 40.0 * 0.875, 25.0))


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
    for kept in range(5, 5 + 2 * LIVE_MIN_PASSES, 2):  # each a 2-token pass: a new token and a draft
        runner.verify_one(VerifyCall("s", kept, [kept + 1], [kept + 2], None, greedy, 0))
    after = runner.describe()
    assert after.calibrated_pass_ms == info.calibrated_pass_ms
    assert after.live_pass_ms[1] != info.live_pass_ms[1]  # LIVE_MIN_PASSES 2-token verifies
    # The only size served often enough: every other follows its live ÷ calibrated.
    moved = after.live_pass_ms[1] / info.calibrated_pass_ms[1]
    assert after.live_pass_ms == pytest.approx(tuple(ms * moved for ms in info.calibrated_pass_ms))


def test_calibration_is_capped_and_off_means_no_costs(tiny_pair):
    runner = target_server.load_runner(
        model_service_config(TargetConfig, tiny_pair.target, max_speculative_tokens=16, calibrate=True)
    )
    assert len(runner.describe().calibrated_pass_ms) == CALIBRATION_MAX_TOKENS
    plain = target_server.load_runner(model_service_config(TargetConfig, tiny_pair.target))
    assert plain.describe().calibrated_pass_ms == ()
    assert isinstance(plain, TargetRunner)
