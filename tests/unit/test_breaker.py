"""The draft's circuit breaker: opens after consecutive failures, closes on a good probe."""

from __future__ import annotations

import pytest

from coordinator.breaker import CircuitBreaker


def test_opens_after_consecutive_failures_only():
    breaker = CircuitBreaker(failure_threshold=3, clock=lambda: 10.0)
    assert not breaker.record_failure() and not breaker.record_failure()
    breaker.record_success()  # a success in between resets the count
    assert not breaker.record_failure() and not breaker.record_failure() and breaker.allow()
    assert breaker.record_failure(), "the third failure in a row opens it"
    assert not breaker.allow() and breaker.is_open and breaker.opened_at == 10.0
    assert not breaker.record_failure(), "already open: not opened again"
    assert breaker.times_opened == 1


def test_a_good_probe_closes_it():
    breaker = CircuitBreaker(failure_threshold=1)
    breaker.record_failure()
    breaker.close()
    assert breaker.allow() and breaker.consecutive_failures == 0
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
