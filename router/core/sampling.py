"""A token bucket that says yes to at most ``rate`` events a second, after a burst of ``burst``.

For the work done once per answer that only feeds averages (how right the prefix index was,
bytes per token, how much of an answer is found cached): at the rates of agents' traffic every
answer is read, and at thousands a second a few hundred pin the averages down as well. Reading
an answer's usage was an eighth of a short request's CPU in the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RateSampler:
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
