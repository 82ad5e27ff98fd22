"""A token bucket that says yes to at most ``rate`` events a second, after a burst of ``burst``.

For the work done once per answer that only feeds averages: reading an answer's usage (how
right the prefix index was, bytes per token, how much of an answer is found cached) and
learning from a streamed first byte (the calibrator's fit). At the rates of agents' traffic
every answer is taken; at thousands a second a few hundred pin the averages down as well, and
the two were a quarter of a short request's CPU in the gateway (docs/performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RateSampler:
    """``take()`` is True for at most ``rate`` calls a second; ``taken`` and ``declined`` count
    the answers."""

    __slots__ = ("_burst", "_clock", "_last", "_rate", "_tokens", "declined", "taken")

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self._rate = rate
        self._burst = burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()
        self.taken = 0
        self.declined = 0

    def take(self) -> bool:
        """True if this event is one to handle."""
        now = self._clock()
        tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            self.taken += 1
            return True
        self._tokens = tokens
        self.declined += 1
        return False
