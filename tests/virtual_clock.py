"""An event loop whose clock moves only when every task is waiting on a timer.

Timer behaviour (an idle timeout, a deadline) tested on the real clock fails on a loaded
machine: a stall longer than the timeout between two steps looks like a quiet stream. On this
loop ``loop.time()`` is virtual. When the loop has nothing ready and would block until its next
timer, the clock jumps to that timer instead, so a timeout fires exactly when no step was
possible before it, however slowly the machine runs the steps. Only for code that waits on
timers and in-loop events: the clock also jumps while real I/O (a socket, a thread) is still
on its way, so such tests keep the real loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        selector = self._selector  # type: ignore[attr-defined]
        real_select = selector.select

        def select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            ready: list[tuple[selectors.SelectorKey, int]] = real_select(0)
            if not ready:
                if timeout is None:  # no timer either: the real loop would wait forever
                    raise RuntimeError("every task waits and no timer is due: a deadlock")
                self._now += timeout  # what the real loop would have slept
            return ready

        selector.select = select

    def time(self) -> float:
        return self._now


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a fresh virtual-clock loop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
