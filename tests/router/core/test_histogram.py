"""The lock-free histogram exposes what prometheus_client's Histogram does for the same data."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from router.core.histogram import LoopHistogram

VALUES = [-300.0, -64.0, -1.0, 0.0, 0.5, 16.0, 63.9, 64.0, 1e9]
BUCKETS = (-256.0, -64.0, 0.0, 64.0, 4096.0)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("labelled", [False, True])
def test_same_exposition_as_the_library_histogram(labelled: bool) -> None:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    names = ["mode"] if labelled else []
    fast = LoopHistogram("h", "doc", names, buckets=BUCKETS, registry=mine)
    slow = Histogram("h", "doc", names, buckets=BUCKETS, registry=theirs)
    for value in VALUES:
        if labelled:
            fast.labels("a").observe(value)
            slow.labels("a").observe(value)
        else:
            fast.observe(value)
            slow.observe(value)
    expected = samples(theirs)
    assert samples(mine) == expected
    # Negative bounds keep the count (HistogramMetricFamily would drop it).
    assert expected[("h_count", (("mode", "a"),) if labelled else ())] == len(VALUES)


def test_nan_is_not_counted() -> None:
    registry = CollectorRegistry()
    h = LoopHistogram("h", "doc", buckets=(1.0,), registry=registry)
    h.observe(math.nan)
    h.observe(2.0)
    got = samples(registry)
    assert got[("h_count", ())] == 1.0 and got[("h_sum", ())] == 2.0


def test_labels_are_checked() -> None:
    h = LoopHistogram("h", "doc", ["mode"], buckets=(1.0,))
    with pytest.raises(ValueError, match="expected labels"):
        h.labels("a", "b")
    with pytest.raises(ValueError, match="has labels"):
        h.observe(1.0)
    assert h.labels("a") is h.labels("a")


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        LoopHistogram("h", "doc", buckets=(2.0, 1.0))
