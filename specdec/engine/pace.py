"""Emulated accelerator timing (`python -m bench.emulated --pass-cost-profile FILE`).

A model service with a profile runs its real model (tiny in tests), then holds each forward
pass until the profile's time for that pass has passed since the pass began. It sleeps while it
holds, so the host CPU is as idle as it is while a GPU computes, and the draft and the target
overlap as they would on accelerators of their own. Start-up calibration, `Info` and the
coordinator's K chooser see the emulated costs, as they would see a GPU's. What an accelerator
does in device memory is part of its pass: a batched pass holds the padding of its sessions'
caches into one batch and their splitting back (specdec.engine.batching) inside its time, as
a GPU would copy them, rather than adding them after it as host work.

A pass's time is the profile's `pass_ms` interpolated linearly at the pass's new tokens (summed
over the sessions of a batched pass; past the last point, extrapolated from the last two), plus
`context_ms_per_1k` for every thousand tokens those sessions hold in their caches. A pass whose
real compute already took longer is an *overrun*: the emulation no longer stands for the
accelerator, so the service counts them (`Info.emulation_overruns`, a metric) and the
benchmark prints them beside its figures.

The file is JSON: {"name": ..., "source": ..., "pass_ms": [[tokens, ms], ...],
"context_ms_per_1k": ms}; `bench/profiles/` holds published ones.
"""

from __future__ import annotations

import ctypes
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PR_SET_TIMERSLACK = 29  # prctl(2)
_thread = threading.local()


def sleep_precisely(seconds: float) -> None:
    """time.sleep with this thread's timer slack at 1 ns (precise_sleeps)."""
    precise_sleeps()
    time.sleep(seconds)


def precise_sleeps() -> None:
    """Sets this thread's timer slack to 1 ns, once per thread (Linux; elsewhere nothing).

    Linux may wake a sleeping thread up to its timer slack (50 µs by default) late, on top of
    the scheduler's own latency, so every held pass would end that much after its profile's
    time: a 10 ms sleep overshot by 0.11 ms (median) here, 0.05 ms with a 1 ns slack (2-core
    AMD EPYC VM). A round of six draft steps and a verify lost 0.4 ms to it."""
    if getattr(_thread, "precise", False):
        return
    _thread.precise = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):  # no libc symbol to call: keep the default slack
            pass


@dataclass(frozen=True)
class PassCostProfile:
    """What one forward pass costs on the accelerator a service stands in for."""

    name: str
    pass_ms: tuple[tuple[int, float], ...]  # (new tokens, ms), tokens strictly increasing
    context_ms_per_1k: float
    source: str = ""  # where the figures come from

    def ms(self, new_tokens: int, context_tokens: int) -> float:
        """The pass's emulated time: interpolated at `new_tokens`, plus the context's share."""
        points = self.pass_ms
        if len(points) == 1 or new_tokens <= points[0][0]:
            base = points[0][1]
        else:
            upper = next((i for i, (tokens, _) in enumerate(points) if tokens >= new_tokens), len(points) - 1)
            (x0, y0), (x1, y1) = points[upper - 1], points[upper]
            base = y0 + (y1 - y0) * (new_tokens - x0) / (x1 - x0)
        return max(0.0, base) + self.context_ms_per_1k * context_tokens / 1000.0


def load_profile(path: str) -> PassCostProfile:
    """The profile in `path`; a malformed one raises ValueError naming the field at fault."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object with pass_ms and context_ms_per_1k")
    points = data.get("pass_ms")
    if not isinstance(points, list) or not points:
        raise ValueError("pass_ms must be a non-empty list of [new tokens, ms] pairs")
    parsed: list[tuple[int, float]] = []
    for index, point in enumerate(points):
        if not (
            isinstance(point, list)
            and len(point) == 2
            and isinstance(point[0], int)
            and not isinstance(point[0], bool)
            and isinstance(point[1], (int, float))
            and not isinstance(point[1], bool)
        ):
            raise ValueError(f"pass_ms[{index}] must be a [new tokens, ms] pair of numbers; got {point!r}")
        tokens, ms = point[0], float(point[1])
        if tokens < 1 or ms < 0:
            raise ValueError(f"pass_ms[{index}] = {point!r}: tokens must be >= 1 and ms >= 0")
        if parsed and tokens <= parsed[-1][0]:
            raise ValueError(f"pass_ms[{index}]: token counts must increase; {tokens} follows {parsed[-1][0]}")
        parsed.append((tokens, ms))
    context = data.get("context_ms_per_1k")
    if not isinstance(context, (int, float)) or isinstance(context, bool) or context < 0:
        raise ValueError(f"context_ms_per_1k must be a number >= 0; got {context!r}")
    name, source = data.get("name", Path(path).stem), data.get("source", "")
    if not isinstance(name, str) or not isinstance(source, str):
        raise ValueError("name and source must be strings")
    return PassCostProfile(name, tuple(parsed), float(context), source)


class Pacer:
    """Holds each pass to its profile's time, and counts the passes whose real compute overran it."""

    def __init__(
        self,
        profile: PassCostProfile,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = sleep_precisely,
    ) -> None:
        self.profile = profile
        self._clock = clock
        self._sleep = sleep
        self.passes = 0
        self.overruns = 0  # passes whose real compute took longer than the profile allows
        self.worst_overrun_ms = 0.0

    @contextmanager
    def hold(self, new_tokens: int, context_tokens: int) -> Iterator[None]:
        """Around one pass: on exit, sleeps until the profile's time for it has passed since entry."""
        started = self._clock()
        yield
        allowed = self.profile.ms(new_tokens, context_tokens) / 1e3
        elapsed = self._clock() - started
        self.passes += 1
        if elapsed > allowed:
            self.overruns += 1
            self.worst_overrun_ms = max(self.worst_overrun_ms, (elapsed - allowed) * 1e3)
            if self.overruns == 1 or self.overruns % 1000 == 0:
                logger.warning(
                    "emulation overrun %d: a pass of %d new tokens computed for %.1f ms, the profile %s allows "
                    "%.1f ms; the emulation does not hold for such passes (fewer torch threads, or an idle core, "
                    "keep the real compute below the profile)",
                    self.overruns,
                    new_tokens,
                    elapsed * 1e3,
                    self.profile.name,
                    allowed * 1e3,
                )
        else:
            self._sleep(allowed - elapsed)
