"""The simulated clock of one engine.

Simulated seconds run ``speed`` times faster than the event loop's wall clock. The engine
advances ``now`` by whole steps and sleeps until each step's end mapped back to wall time, so
sleep jitter never accumulates. A late engine runs the next step at once; one that falls
more than ``CATCH_UP_LIMIT_S`` (wall) behind re-anchors instead of bursting through steps.
"""

from __future__ import annotations

import asyncio

CATCH_UP_LIMIT_S = 0.05


class SimClock:
    """Maps simulated time to the running loop's wall clock."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.now = 0.0
        self._anchor_wall = 0.0
        self._anchor_sim = 0.0
        self._step_end: float | None = None

    def _wall(self) -> float:
        return asyncio.get_running_loop().time()

    def mapped(self) -> float:
        """Simulated time corresponding to the wall clock now."""
        return self._anchor_sim + (self._wall() - self._anchor_wall) * self.speed

    def arrival_time(self) -> float:
        """Timestamp for something happening now; never past the step being computed."""
        mapped = max(self.mapped(), self.now)
        return mapped if self._step_end is None else min(mapped, self._step_end)

    def restart(self, start: float | None = None) -> None:
        """After idling: simulated time resumes at ``start`` (default: now on the wall)."""
        wall = self._wall()
        if start is None:
            start = self._anchor_sim + (wall - self._anchor_wall) * self.speed
        self.now = max(self.now, start)
        self._anchor_wall, self._anchor_sim = wall, self.now

    async def run_step(self, duration: float) -> None:
        """Sleep until a step of ``duration`` simulated seconds ends; ``now`` moves to its end."""
        end = self.now + duration
        self._step_end = end
        delay = self._anchor_wall + (end - self._anchor_sim) / self.speed - self._wall()
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                if -delay > CATCH_UP_LIMIT_S:
                    self._anchor_wall, self._anchor_sim = self._wall(), end
                await asyncio.sleep(0)  # stay cooperative even when behind schedule
        finally:
            self._step_end = None
        self.now = end
