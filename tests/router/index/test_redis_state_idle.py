"""The in-flight sync loop while the fleet is idle: it calls Redis only often enough to stay a
live member, and every tick again as soon as anything is in flight, here or elsewhere."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from router.index import redis_state
from router.index.redis_state import SharedInFlight
from tests.manual_clock import ManualClock
from tests.router.index.shared_inflight import inflight

pytestmark = pytest.mark.redis



class Ticks:
    """``sleep`` for :class:`SharedInFlight`: each call moves ``clock`` on by the delay asked
    and runs ``on_tick`` with the calls so far; after ``limit`` calls it parks the loop and
    sets ``done``."""

    def __init__(
        self, clock: ManualClock, limit: int, on_tick: Callable[[int], None] = lambda _: None
    ) -> None:
        self.clock, self.limit, self.on_tick, self.calls = clock, limit, on_tick, 0
        self.done = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.calls += 1
        self.clock.now += delay
        self.on_tick(self.calls)
        if self.calls >= self.limit:
            self.done.set()
            await asyncio.Event().wait()  # until the test closes the loop
        await asyncio.sleep(0)


async def synced_at(shared: SharedInFlight, ticks: Ticks, clock: ManualClock) -> list[float]:
    """Run ``shared``'s loop for ``ticks.limit`` ticks: when it called Redis, on ``clock``."""
    at: list[float] = []
    sync = shared.sync_once

    async def spy(counts: Any = None) -> bool:
        at.append(clock.now)
        return await sync(counts)

    shared.sync_once = spy  # type: ignore[method-assign]
    shared.start()
    await ticks.done.wait()
    await shared.aclose()
    return at


async def test_an_idle_fleet_is_synced_rarely_but_within_expiry(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    """Nothing in flight here nor anywhere else: each sync would publish and read nothing, so
    the loop calls Redis only often enough to stay a live member (well within ``expiry``)."""
    clock = ManualClock(100.0)
    ticks = Ticks(clock, limit=80)  # 6 s of 75 ms ticks
    shared = inflight(redis_url, redis_namespace, closing, {}, clock=clock, sleep=ticks)
    calls = await synced_at(shared, ticks, clock)
    assert len(calls) <= 6 / redis_state.IDLE_SYNC_S + 2  # the old loop: 80
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert max(gaps) <= redis_state.IDLE_SYNC_S + 0.075 + 1e-9 < 1.5 / 2


async def test_load_here_or_elsewhere_keeps_every_tick_synced(
    redis_url: str, redis_namespace: str, closing: list[Any]
) -> None:
    """Anything in flight, here or at another gateway, and the loop syncs every tick as ever;
    load that appears here is published at the next tick, not after the idle period."""
    clock = ManualClock(100.0)
    counts: dict[str, int] = {}

    def arrive(tick: int) -> None:
        if tick == 2:
            counts["e1"] = 1  # a request arrives here between two idle syncs

    ticks = Ticks(clock, limit=40, on_tick=arrive)
    shared = inflight(redis_url, redis_namespace, closing, counts, clock=clock, sleep=ticks)
    calls = await synced_at(shared, ticks, clock)
    assert calls[:2] == [100.0, pytest.approx(100.0 + 2 * 0.075)]
    assert len(calls) == ticks.limit - 1  # every tick from then on: the old loop, all 40

    other = inflight(redis_url, redis_namespace, closing, {"e2": 3}, gateway_id="other")
    assert await other.sync_once()
    ticks = Ticks(clock, limit=20)
    reader = inflight(redis_url, redis_namespace, closing, {}, clock=clock, sleep=ticks)
    calls = await synced_at(reader, ticks, clock)
    assert len(calls) == 20 and reader.remote_in_flight("e2") == 3
