"""The loop-lag monitor records how late a blocked loop ran its timer."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

from router.api.loop_lag import LoopLagMonitor


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("lag_seconds", "lag", buckets=(0.01, 0.1), registry=registry)


def _value(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    return 0.0 if value is None else value


async def test_a_blocked_loop_shows_as_lag() -> None:
    registry, histogram = _histogram()
    monitor = LoopLagMonitor(histogram, interval=0.01)
    monitor.start()
    await asyncio.sleep(0.03)  # a few on-time ticks first
    before = _value(registry, "lag_seconds_sum")
    time.sleep(0.08)  # noqa: ASYNC251 -- blocking the loop is what this test is about
    for _ in range(100):  # bounded: the late tick lands within a tick or two
        await asyncio.sleep(0.01)
        if _value(registry, "lag_seconds_sum") - before >= 0.05:
            break
    await monitor.stop()
    assert _value(registry, "lag_seconds_sum") - before >= 0.05


async def test_stop_ends_the_task_and_start_is_idempotent() -> None:
    registry, histogram = _histogram()
    monitor = LoopLagMonitor(histogram, interval=0.005)
    monitor.start()
    monitor.start()
    await asyncio.sleep(0.05)
    await monitor.stop()
    count = _value(registry, "lag_seconds_count")
    assert count >= 1
    await asyncio.sleep(0.03)
    assert _value(registry, "lag_seconds_count") == count
    await monitor.stop()  # a second stop is harmless
