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
    fastest,
    settled,
)
from specdec.sampling.probs import SamplingParams
from target_service import server as target_server
from target_service.config import TargetConfig
from target_service.runner import TargetRunner, VerifyCall
from tests.stack import model_service_config


def test_calibrate_sweeps_every_size_keeps_the_quick_end_and_times_slow_passes_twice(monkeypatch):
    import specdec.engine.costs as costs_module

    now = [0.0]
    # Two warm-ups, and one of each other size; a sweep up (sizes 1-4: 5, 7, 400, 200 ms); a
    # sweep down (4-1: 150, 300, 6, 3); a sweep up again (1, 2, 4: 4, 8, 160; size 3, slow
    # twice, is not timed again). The quick end of each size's runs: 3, 6, 300, 150; size 3
    # came out dearer than size 4, so it was disturbed and takes 150.
    durations = iter([1.0] * 5 + [5.0, 7.0, 400.0, 200.0, 150.0, 300.0, 6.0, 3.0, 4.0, 8.0, 160.0])
    calls: list[int] = []

    def run_pass(n: int) -> None:
        calls.append(n)
        now[0] += next(durations) / 1e3

    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    measured = calibrate(run_pass, 4, sweeps=3, warmup=2)
    assert calls == [1, 1, 2, 3, 4, 1, 2, 3, 4, 4, 3, 2, 1, 1, 2, 4]
    assert measured == pytest.approx((3.0, 6.0, 150.0, 150.0))


def test_one_disturbed_run_does_not_set_a_sizes_cost(monkeypatch):
    """A burst slowing a size's first timed run past REPEAT_BELOW_MS: the size is timed again,
    and its figure is its own; so is a batched pass's."""
    import specdec.engine.costs as costs_module

    now = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])
    timed = {"first five": True}

    def run_pass(n: int) -> None:
        slow = n == 5 and timed["first five"] and len(calls) >= 6  # after the six warm-ups
        timed["first five"] = timed["first five"] and not slow
        calls.append(n)
        now[0] += (300.0 if slow else 10.0 + n) / 1e3

    calls: list[int] = []
    assert calibrate(run_pass, 5) == pytest.approx((11.0, 12.0, 13.0, 14.0, 15.0))
    durations = iter([260.0, 20.0, 20.0])

    def batched() -> None:
        now[0] += next(durations) / 1e3

    assert fastest(batched) == pytest.approx(20.0)


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
    assert (runner.batched_forwards, runner.batched_sessions_total, runner.max_batch_size_seen) == (0, 0, 0)
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


def test_a_lone_sessions_draft_steps_in_a_decode_batch_are_live_passes(tiny_pair):
    """The draft service hands even a lone call to a decode batch (its batcher lets others
    join): its one-token steps there are one-session passes the live figures learn from."""
    from draft_service import server as draft_server
    from draft_service.config import DraftConfig
    from draft_service.runner import ProposeCall

    config = model_service_config(DraftConfig, tiny_pair.draft, max_speculative_tokens=4, calibrate=True)
    runner = draft_server.load_runner(config)
    kept, new = 0, list(range(3, 23))
    for round_index in range(LIVE_MIN_PASSES):
        call = ProposeCall("s", kept, new, 4, SamplingParams(), seed=round_index)
        (proposal,) = runner.propose_batch([call], lambda index, result: None, lambda held: [])
        assert not isinstance(proposal, Exception), proposal
        kept, new = kept + len(new) + 1, [5]
    assert len(runner.pass_costs.recent[0]) >= 3 * LIVE_MIN_PASSES  # K - 1 one-token steps a call


def test_calibration_is_capped_and_off_means_no_costs(tiny_pair):
    runner = target_server.load_runner(
        model_service_config(TargetConfig, tiny_pair.target, max_speculative_tokens=16, calibrate=True)
    )
    assert len(runner.describe().calibrated_pass_ms) == CALIBRATION_MAX_TOKENS
    plain = target_server.load_runner(model_service_config(TargetConfig, tiny_pair.target))
    assert plain.describe().calibrated_pass_ms == ()
    assert isinstance(plain, TargetRunner)
