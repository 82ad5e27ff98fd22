"""The request path's timeouts, checked on one coarse tick instead of a timer each.

A request waits under three timeouts (its body arriving, the first byte, the relay going idle),
all seconds long. A loop timer for each (``asyncio.timeout``, or a bare ``call_at``) is a
timer handle made and cancelled per wait: several microseconds a request, a few percent of
the gateway's CPU. Here a wait registers in a set, and one timer per ``tick`` checks the set
while any wait is registered; a timeout fires up to one tick late, which no timeout measured
in seconds notices.
"""

from __future__ import annotations

import asyncio

TICK_S = 0.05


class Deadline:
    """Cancels its task once ``timeout`` seconds pass without a :meth:`touch`."""

    __slots__ = ("_base", "_loop", "_owner", "_task", "expired", "last", "timeout")

    def __init__(self, owner: Deadlines, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._owner = owner
        self._loop = loop
        self._task = asyncio.current_task()
        # Cancellations already pending when the deadline began are not the deadline's.
        self._base = self._task.cancelling() if self._task is not None else 0
        self.timeout = timeout
        self.last = loop.time()
        self.expired = False

    def touch(self) -> None:
        """The timeout counts from now."""
        self.last = self._loop.time()

    def stop(self) -> None:
        self._owner.discard(self)

    def expire(self) -> None:
        # A task already being cancelled (client gone, shutdown) keeps that reason.
        if self._task is not None and not self._task.cancelling():
            self.expired = True
            self._task.cancel()

    def absorb_expiry(self) -> bool:
        """After a CancelledError: True (and the cancel undone) if this deadline caused it."""
        if not self.expired:
            return False
        self.expired = False
        # Another cancellation on top of ours (a disconnect, the drain deadline) still stands.
        return self._task is None or self._task.uncancel() <= self._base


class Deadlines:
    """The live deadlines of one event loop's requests, and the tick that checks them."""

    def __init__(self, tick: float = TICK_S) -> None:
        self._tick = tick
        self._live: set[Deadline] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self, timeout: float) -> Deadline:
        """A deadline for the current task, ``timeout`` seconds from now."""
        loop = asyncio.get_running_loop()
        if self._handle is None or loop is not self._loop:
            if self._handle is not None:  # another loop's (tests): its waits are not ours
                self._handle.cancel()
                self._live.clear()
            self._loop = loop
            self._handle = loop.call_later(self._tick, self._check)
        deadline = Deadline(self, loop, timeout)
        self._live.add(deadline)
        return deadline

    def discard(self, deadline: Deadline) -> None:
        self._live.discard(deadline)

    def __len__(self) -> int:
        return len(self._live)

    def _check(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        due = [d for d in self._live if now >= d.last + d.timeout]
        for deadline in due:
            self._live.discard(deadline)
            deadline.expire()
        self._handle = loop.call_later(self._tick, self._check) if self._live else None
