"""A circuit breaker for the draft service.

The draft is an accelerator, not a dependency: when it is down, rounds run target-only (K=0),
which is exactly the target's own decoding, so outputs do not change, only speed. The breaker
stops every round of every request from first paying retries and deadlines against a dead
draft: after `failure_threshold` consecutive failures it opens and rounds skip the draft until
a health probe (run by the coordinator every `probe_interval_s`) finds it SERVING again.

Pure state and a clock; no gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1; got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self._clock = clock
        self.consecutive_failures = 0
        self.opened_at: float | None = None  # None: closed
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allow(self) -> bool:
        """Whether a round may call the draft."""
        return self.opened_at is None

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self) -> bool:
        """Counts a failed draft call; returns True when this failure opened the breaker."""
        self.consecutive_failures += 1
        if self.opened_at is None and self.consecutive_failures >= self.failure_threshold:
            self.opened_at = self._clock()
            self.times_opened += 1
            return True
        return False

    def trip(self) -> None:
        """Opens now, whatever the count: the replica stopped answering health probes."""
        if self.opened_at is None:
            self.opened_at = self._clock()
            self.times_opened += 1

    def close(self) -> None:
        """The draft answered a health probe: speculation resumes."""
        self.opened_at = None
        self.consecutive_failures = 0
