from __future__ import annotations

import pytest

from router.core.sampling import RateSampler
from tests.manual_clock import ManualClock


def test_a_burst_then_the_rate() -> None:
    clock = ManualClock(100.0)
    sampler = RateSampler(rate=4.0, burst=3.0, clock=clock)
    assert [sampler.take() for _ in range(5)] == [True, True, True, False, False]
    clock.now += 0.25  # one event's worth at 4 a second
    assert [sampler.take() for _ in range(3)] == [True, False, False]
    clock.now += 60.0  # refilled, never beyond the burst
    assert sum(sampler.take() for _ in range(10)) == 3
    assert (sampler.taken, sampler.declined) == (7, 11)


def test_over_a_long_run_the_share_follows_the_rate() -> None:
    clock = ManualClock(100.0)
    sampler = RateSampler(rate=50.0, burst=5.0, clock=clock)
    taken = 0
    for _ in range(10_000):  # 1,000 events a second for 10 seconds
        clock.now += 0.001
        taken += sampler.take()
    assert 500 <= taken <= 506


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        RateSampler(rate=0.0, burst=1.0)
    with pytest.raises(ValueError):
        RateSampler(rate=1.0, burst=0.5)
