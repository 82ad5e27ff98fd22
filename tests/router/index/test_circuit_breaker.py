"""The circuit breaker in front of the shared stores' Redis calls."""

from __future__ import annotations

import pytest

from router.index.circuit_breaker import CircuitBreaker
from tests.manual_clock import ManualClock


def test_breaker_opens_after_threshold_and_probes_once() -> None:
    clock = ManualClock(100.0)
    breaker = CircuitBreaker(threshold=2, initial_seconds=1.0, max_seconds=3.0, clock=clock)
    breaker.failure()
    assert breaker.allow() and not breaker.is_open
    breaker.failure()
    assert breaker.is_open and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # everyone else waits for its outcome
    breaker.failure()
    assert breaker.retry_in() == pytest.approx(2.0)  # the interval grows
    clock.now += 2.0
    assert breaker.allow()
    breaker.failure()
    assert breaker.retry_in() == pytest.approx(3.0)  # up to the cap
    clock.now += 3.0
    assert breaker.allow()
    breaker.success()
    assert not breaker.is_open and breaker.allow() and breaker.retry_in() == 0
