"""How late the event loop runs what is ready: the gateway's CPU headroom, as one histogram.

Every request's work (reading the body, hashing, routing, relaying each chunk) runs on one
event loop. When that loop has more to do than the CPU it gets, every ready callback waits its
turn, and the wait lands on time to first token and on inter-token latency alike, where no
per-request figure shows where it came from. A timer that asks to wake every ``interval``
and records by how much it overslept measures exactly that wait: under a millisecond on a
gateway with headroom, several on one that is CPU-bound or starved by its neighbours.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

from router.core.tasks import cancel_and_wait

# Often enough to catch a busy second; rare enough (20 wake-ups a second) to cost nothing.
DEFAULT_INTERVAL = 0.05


class LoopLagMonitor:
    """Feeds ``histogram`` with the loop's lateness while started; owned by the lifespan."""

    def __init__(self, histogram: Histogram, interval: float = DEFAULT_INTERVAL) -> None:
        self._histogram = histogram
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self._interval)
            self._histogram.observe(max(0.0, loop.time() - asked - self._interval))
