"""A circuit breaker for calls to a shared store: after a few failures in a row the calls are
skipped for a growing interval, so a slow or absent server costs requests nothing (callers fall
back to local state) and calls resume by themselves once it answers again."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


class CircuitBreaker:
    """Skip Redis for a growing interval after ``threshold`` consecutive failures.

    Once the interval has passed a single probe call goes through (the others keep skipping
    until it reports), so a dead Redis costs one budget per interval, not one per request.
    """

    def __init__(
        self,
        threshold: int = 3,
        initial_seconds: float = 0.2,
        max_seconds: float = 5.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self._threshold = max(1, threshold)
        self._initial = initial_seconds
        self._max = max_seconds
        self._clock = clock
        self._failures = 0
        self._interval = initial_seconds
        self._open_until: float | None = None

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def retry_in(self) -> float:
        if self._open_until is None:
            return 0.0
        return max(0.0, self._open_until - self._clock())

    def allow(self) -> bool:
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        self._open_until = now + self._interval
        return True

    def success(self) -> None:
        self._failures = 0
        self._interval = self._initial
        self._open_until = None

    def failure(self) -> None:
        now = self._clock()
        if self._open_until is not None:
            self._interval = min(self._interval * 2, self._max)
            self._open_until = now + self._interval
            return
        self._failures += 1
        if self._failures >= self._threshold:
            self._open_until = now + self._interval
