"""What a forward pass costs on the hardware a service runs on, measured rather than assumed.

Whether verifying K + 1 tokens costs about as much as one depends on the machine: flat on a
GPU or with AVX512-BF16, three times as much for bf16 on an AVX2-only CPU. Each model service
therefore times its own passes at start-up (the calibrated figures, fixed until a restart so
that the coordinator's choice of K, and hence a seed's output, does not move) and keeps live
figures beside them: each size's recent one-session passes, settled as calibration settles
them. A machine's costs move after start-up (on the 2-core VMs, a one-token pass of the int8
1.5B target costs 34-37 ms for minutes and 46-54 ms for others), so the coordinator chooses K
from the live figures for the requests whose output K cannot change (coordinator.adaptive).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LIVE_WINDOW = 32  # a size's live figure is taken over its last this many passes
LIVE_MIN_PASSES = 8  # ... once it has this many; before, its calibrated figure scaled as served sizes moved
CALIBRATION_CONTEXT = 128  # cached tokens under the timed passes: a typical chat prompt
CALIBRATION_MAX_TOKENS = 9  # sizes timed: 1..9 new tokens (K <= 8); larger ones are extrapolated
REPEAT_BELOW_MS = 250.0  # a pass slower than this twice is timed no more: calibration stays within seconds


@dataclass
class PassCosts:
    """ms per forward pass by number of new tokens: index i is i + 1 tokens."""

    calibrated_ms: tuple[float, ...]
    context_tokens: int
    batch_ms: tuple[tuple[int, int, float], ...] = ()  # (sessions, new tokens each, ms) of batched passes
    recent: tuple[deque[float], ...] = field(init=False)  # [n - 1]: the last LIVE_WINDOW passes' ms

    def __post_init__(self) -> None:
        self.recent = tuple(deque(maxlen=LIVE_WINDOW) for _ in self.calibrated_ms)

    def observe(self, new_tokens: int, ms: float) -> None:
        """A live one-session pass; sizes outside the calibrated range are ignored."""
        if 1 <= new_tokens <= len(self.recent):
            self.recent[new_tokens - 1].append(ms)

    @property
    def live_ms(self) -> tuple[float, ...]:
        """Each size's recent passes settled as calibration settles its sweeps (the lower
        quartile: a burst only slows a pass), where it has LIVE_MIN_PASSES of them. A size
        served less often keeps its calibrated figure scaled as the served sizes beside it
        moved (their live ÷ calibrated, interpolated between the nearest served sizes below
        and above, or the nearest one's past the ends), so a state that slows or speeds every
        pass moves the sizes the chooser has not tried too, and one calibrated in a disturbed
        state does not leave them priced out of reach; with no size served, the calibrated
        figures. The passes are at whatever contexts were served, so the figures are this
        deployment's costs now, not comparable across deployments serving other prompts."""
        calibrated = self.calibrated_ms
        served = {
            i: settled(list(runs)) / calibrated[i] for i, runs in enumerate(self.recent) if len(runs) >= LIVE_MIN_PASSES
        }
        if not served:
            return tuple(calibrated)
        sizes = sorted(served)
        # Linear between served sizes, the nearest one's ratio past either end.
        scales = np.interp(range(len(calibrated)), sizes, [served[i] for i in sizes])
        return tuple(float(ms * scale) for ms, scale in zip(calibrated, scales, strict=True))


def calibrate(
    run_pass: Callable[[int], None], max_new_tokens: int, sweeps: int = 12, warmup: int = 2
) -> tuple[float, ...]:
    """Times `run_pass(n)` for n = 1..max_new_tokens in `sweeps` sweeps over every size, up,
    down, up, down, and keeps each size's lower quartile (`settled`). Sweeping, rather than
    timing each size's runs back to back, puts a drift in the machine's speed on every size
    alike: timed size by size, a VM slowing through calibration read as a steep curve (39 ms for
    one token, 78 for nine, against 50 and 66 for the same model calibrated beside it), and that
    deployment's K chooser took 51 rounds where its neighbours took 31.

    The lower quartile of twelve sweeps, rather than the median of four: this VM's disturbances
    come in bursts that only ever slow a pass, so the median of four moved with them. Over
    150 s of sweeps of the int8 1.5B target (2 threads, AVX-512), windows of four sweeps'
    medians put nine tokens at 1.27-1.67× one token's cost (sd 0.064), enough to move the
    chooser's K; twelve sweeps' lower quartiles put it at 1.37-1.48× (sd 0.025). It costs about
    6 s of that target's start-up. A size whose first two runs take longer than REPEAT_BELOW_MS
    is timed no more, so calibration stays within seconds (a float32 target on 2 cores), and
    one disturbed run does not set a size's figure. Batched passes
    (specdec.engine.calibration) are the fastest of three runs each (two where both are slow).

    `warmup` passes of one token, then one of each other size, run untimed first: a size's
    first pass may set up what the rest reuse (on CUDA a static pass's bucket is captured
    then, which read as a 331 ms nine-token pass on an H200 whose others took 5 ms, and made
    that size timed once)."""
    for _ in range(warmup):
        run_pass(1)
    for n in range(2, max_new_tokens + 1) if warmup else ():
        run_pass(n)
    times: list[list[float]] = [[] for _ in range(max_new_tokens)]
    for sweep in range(sweeps):
        sizes = range(1, max_new_tokens + 1) if sweep % 2 == 0 else range(max_new_tokens, 0, -1)
        for n in sizes:
            if sweep >= 2 and min(times[n - 1]) > REPEAT_BELOW_MS:
                continue
            started = time.perf_counter()
            run_pass(n)
            times[n - 1].append((time.perf_counter() - started) * 1e3)
    costs = [settled(runs) for runs in times]
    # A pass over fewer tokens never costs more than one over more: a size that came out
    # dearer than a larger one was disturbed, and takes the larger one's figure.
    for i in range(len(costs) - 2, -1, -1):
        costs[i] = min(costs[i], costs[i + 1])
    return tuple(costs)


def settled(runs: list[float]) -> float:
    """The lower quartile of one size's timings (the fastest of up to four): a pass the machine
    disturbed is slower, never faster, so the quick end is the pass's own cost, and a quartile
    rather than the minimum keeps one lucky run from setting it."""
    return sorted(runs)[(len(runs) - 1) // 4]


def fastest(run: Callable[[], None], repeats: int = 3) -> float:
    """ms of the fastest of up to `repeats` runs (two, for a pass twice slower than REPEAT_BELOW_MS)."""
    best = float("inf")
    for attempt in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - started) * 1e3)
        if attempt and best > REPEAT_BELOW_MS:
            break
    return best


def batch_grid(max_batch_size: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """The batched passes calibration times: 2, 4, 8, ... sessions up to `max_batch_size` (it
    included), each with 1 and with `max_new_tokens` new tokens (a target-only step, and a
    verify at the largest K); between them the coordinator interpolates."""
    sizes = sorted({*(2**i for i in range(1, max_batch_size.bit_length()) if 2**i < max_batch_size), max_batch_size})
    return [(b, n) for b in sizes if b > 1 for n in sorted({1, max_new_tokens})]


def cost_at(costs: tuple[float, ...] | list[float], new_tokens: int) -> float:
    """The cost of a pass over `new_tokens`, extrapolating linearly past the measured range."""
    if new_tokens <= len(costs):
        return float(costs[max(new_tokens, 1) - 1])
    slope = (costs[-1] - costs[0]) / (len(costs) - 1) if len(costs) > 1 else 0.0
    return float(costs[-1] + max(slope, 0.0) * (new_tokens - len(costs)))


def cpu_model() -> str:
    """/proc/cpuinfo's model name (platform.processor() is often empty on Linux)."""
    import platform

    try:
        match = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    except OSError:
        match = None
    return match.group(1).strip() if match else platform.processor()


def cpu_flags() -> str:
    """The vector extensions every CPU cost depends on (lscpu's flags, filtered): printed beside
    every figure, since the same defaults pay on one CPU and lose on another."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return (
        " ".join(sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|amx[a-z_0-9]*|avx2|avx_vnni|fma)\b", text))))
        or "no AVX2/AVX-512"
    )
