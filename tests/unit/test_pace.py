"""Emulated accelerator timing (specdec.engine.pace): what a profile says a pass costs, how a
malformed one is refused, and how the pacer holds a pass to it."""

from __future__ import annotations

import ctypes
import json
import sys
import threading

import pytest

from specdec.engine.pace import Pacer, PassCostProfile, load_profile

PROFILE = PassCostProfile("test", ((1, 20.0), (16, 24.0), (64, 40.0)), context_ms_per_1k=0.5)

# (new tokens, context tokens) -> ms
COSTS = {
    (1, 0): 20.0,  # a point
    (16, 0): 24.0,
    (8, 0): 20.0 + 4.0 * 7 / 15,  # between points: linear
    (40, 0): 32.0,
    (96, 0): 40.0 + 16.0 * 32 / 48,  # past the last point: the last two points' slope
    (1, 2000): 21.0,  # plus 0.5 ms per 1k cached tokens
    (16, 1000): 24.5,
}


@pytest.mark.parametrize(("tokens", "context"), COSTS)
def test_a_pass_costs_the_profile_interpolated_plus_its_context(tokens, context):
    assert PROFILE.ms(tokens, context) == pytest.approx(COSTS[tokens, context])


def test_one_point_is_a_flat_cost_and_fewer_tokens_than_the_first_point_cost_the_first():
    flat = PassCostProfile("flat", ((1, 7.0),), 0.0)
    assert flat.ms(1, 0) == flat.ms(500, 0) == 7.0
    starts_at_4 = PassCostProfile("four", ((4, 10.0), (8, 12.0)), 0.0)
    assert starts_at_4.ms(1, 0) == 10.0


GOOD = {"name": "h100-test", "source": "a test", "pass_ms": [[1, 22.0], [16, 22.6]], "context_ms_per_1k": 0.3}
BAD = {
    "not JSON": ("{pass_ms", "not JSON"),
    "not an object": ("[1, 2]", "JSON object"),
    "no pass_ms": (json.dumps({"context_ms_per_1k": 0.3}), "pass_ms must be"),
    "a point not a pair": (json.dumps({**GOOD, "pass_ms": [[1, 2, 3]]}), "pass_ms[0]"),
    "tokens not increasing": (json.dumps({**GOOD, "pass_ms": [[4, 1.0], [2, 2.0]]}), "pass_ms[1]: token counts"),
    "a negative time": (json.dumps({**GOOD, "pass_ms": [[1, -1.0]]}), "ms >= 0"),
    "no context_ms_per_1k": (json.dumps({"pass_ms": [[1, 1.0]]}), "context_ms_per_1k"),
    "a negative context cost": (json.dumps({**GOOD, "context_ms_per_1k": -1}), "context_ms_per_1k"),
}


def test_a_profile_file_loads(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(GOOD))
    assert load_profile(str(path)) == PassCostProfile("h100-test", ((1, 22.0), (16, 22.6)), 0.3, "a test")


@pytest.mark.parametrize("case", BAD)
def test_a_malformed_profile_is_refused_naming_what_is_wrong(tmp_path, case):
    text, named = BAD[case]
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_profile(str(path))


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_pacer_sleeps_out_the_rest_of_the_pass_and_counts_overruns():
    time = FakeTime()
    pacer = Pacer(PROFILE, time.clock, time.sleep)
    with pacer.hold(1, 0):
        time.now += 0.005  # 5 ms of real compute against 20 allowed
    assert time.slept == [pytest.approx(0.015)] and pacer.overruns == 0
    with pacer.hold(16, 0):
        time.now += 0.030  # 30 ms against 24: the emulation did not hold
    assert len(time.slept) == 1 and pacer.overruns == 1 and pacer.worst_overrun_ms == pytest.approx(6.0)
    assert pacer.passes == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")
def test_a_held_pass_sleeps_with_a_fine_timer_slack_on_its_own_thread():
    """The thread that holds passes wakes within the scheduler's latency, not up to the default
    50 µs of timer slack late; other threads keep theirs."""

    def slack_ns() -> int:
        return ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK: this thread's, in ns

    pacer = Pacer(PassCostProfile("flat", ((1, 1.0),), 0.0))
    seen: list[int] = []

    def hold_a_pass() -> None:
        before = slack_ns()
        with pacer.hold(1, 0):
            pass
        seen.extend([before, slack_ns()])

    worker = threading.Thread(target=hold_a_pass)
    worker.start()
    worker.join()
    assert seen[0] > 1 and seen[1] == 1
    assert slack_ns() > 1  # this thread held no pass
