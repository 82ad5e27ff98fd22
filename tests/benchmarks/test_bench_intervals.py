"""Bootstrap intervals of one target's TTFT percentile over another's."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.bench.intervals import ratio_interval, resampled_percentile
from benchmarks.bench.metrics import percentile


@pytest.mark.parametrize("q", [90.0, 50.0])
def test_a_resampled_percentile_is_distributed_as_the_percentile_of_a_real_resample(
    q: float,
) -> None:
    # The order-statistic shortcut against building each resample: their means and spreads
    # over many draws agree (a Beta parameter off by one moves the mean by ~10% at q=90;
    # q=50 falls halfway between two ranks, so the second one's draw counts as much).
    draw = random.Random(1)
    values = sorted(draw.expovariate(1.0) for _ in range(20))
    fast, slow = random.Random(2), random.Random(3)
    shortcut = [resampled_percentile(values, q, fast) for _ in range(8000)]
    direct = [percentile(slow.choices(values, k=len(values)), q) for _ in range(8000)]
    assert statistics.fmean(shortcut) == pytest.approx(statistics.fmean(direct), rel=0.02)
    assert statistics.stdev(shortcut) == pytest.approx(statistics.stdev(direct), rel=0.08)
    assert min(shortcut) >= values[0] and max(shortcut) <= values[-1]


def test_the_two_ranks_between_which_a_percentile_falls_are_drawn_jointly() -> None:
    # Ten zeros and ten ones: a resample's median is 0.5 exactly when it holds ten of each,
    # C(20, 10) / 2**20 = 17.6% of resamples.
    values = [0.0] * 10 + [1.0] * 10
    rng = random.Random(4)
    halves = sum(resampled_percentile(values, 50, rng) == 0.5 for _ in range(20000))
    assert halves / 20000 == pytest.approx(0.176, abs=0.006)


def test_the_maximum_is_resampled_too() -> None:
    values = [1.0, 2.0, 3.0]
    draws = {resampled_percentile(values, 100, random.Random(s)) for s in range(200)}
    assert draws == {1.0, 2.0, 3.0}


def test_interval_holds_the_true_ratio_and_narrows_with_more_requests() -> None:
    rng = random.Random(5)
    slow = [rng.expovariate(1 / 1.5) for _ in range(50)]
    fast = [rng.expovariate(1.0) for _ in range(50)]
    few = ratio_interval(slow, fast)
    assert few is not None and few[0] < 1.5 < few[1]
    slow_many = [rng.expovariate(1 / 1.5) for _ in range(2000)]
    fast_many = [rng.expovariate(1.0) for _ in range(2000)]
    many = ratio_interval(slow_many, fast_many)
    assert many is not None and many[0] < 1.5 < many[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 3
    assert many[0] > 1.10  # a clear loss once the samples are many


def test_interval_is_deterministic_and_none_without_samples() -> None:
    a, b = [0.1, 0.2, 0.3, 0.9], [0.1, 0.1, 0.2, 0.4]
    assert ratio_interval(a, b, seed=3) == ratio_interval(a, b, seed=3)
    assert ratio_interval([1.0], b) is None and ratio_interval(a, []) is None
    assert ratio_interval(a, [0.0, 0.0, 0.0]) is None
