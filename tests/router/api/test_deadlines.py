"""The request path's deadlines: one coarse tick for all of them, running only while needed."""

from __future__ import annotations

import asyncio

from router.api.deadlines import TICK_S, Deadlines
from tests import virtual_clock


def test_only_the_due_deadline_fires_and_the_tick_stops_when_none_is_left() -> None:
    deadlines = Deadlines()

    async def waits(seconds: float, stop_after: float | None = None) -> str:
        deadline = deadlines.start(seconds)
        try:
            await asyncio.sleep(stop_after if stop_after is not None else 10)
        except asyncio.CancelledError:
            return "expired" if deadline.absorb_expiry() else "cancelled"
        finally:
            deadline.stop()
        return "done"

    async def main() -> tuple[list[str], int, bool]:
        results = await asyncio.gather(waits(0.2), waits(5, stop_after=0.3), waits(1.0))
        await asyncio.sleep(2 * TICK_S)  # one more tick finds nothing and does not re-arm
        return list(results), len(deadlines), deadlines._handle is None

    assert virtual_clock.run(main()) == (["expired", "done", "expired"], 0, True)


def test_a_deadline_from_another_loop_does_not_stall_the_next_loop() -> None:
    deadlines = Deadlines()

    async def left_behind() -> None:
        deadlines.start(10.0)  # never stopped; its loop ends with the tick pending

    async def expires() -> bool:
        deadline = deadlines.start(0.1)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return deadline.absorb_expiry()
        return False

    virtual_clock.run(left_behind())
    assert virtual_clock.run(expires()) is True
    assert len(deadlines) == 0
