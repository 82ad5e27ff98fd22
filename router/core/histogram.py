"""A Prometheus histogram for the request path: observed from the event loop's thread only.

``prometheus_client.Histogram`` takes a lock twice per observation (its sum and its bucket)
and walks the bucket bounds in Python; the request path observes six histograms a request,
which made them a few percent of the gateway's CPU. Here an observation is a bisect and two
additions, and the cumulative buckets are summed when Prometheus scrapes. Every observation
comes from the event loop's thread (a gateway process has one loop), so nothing is locked: a
scrape on another thread may read a count one observation ahead of the sum, as it may with
the library's own histograms between their two locks.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# The library's own text for a bound ("+Inf", "1e+06"...), untyped there.
_go_string = cast(Callable[[float], str], floatToGoString)

DEFAULT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0
)


class HistogramChild:
    """The counts of one label set."""

    __slots__ = ("_bounds", "_les", "counts", "total")

    def __init__(self, bounds: tuple[float, ...], les: tuple[str, ...]) -> None:
        self._bounds = bounds
        self._les = les
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        if value != value:  # NaN belongs to no bucket (nor, here, to the sum)
            return
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, as the exposition format has them."""
        out: list[tuple[str, float]] = []
        acc = 0
        for le, count in zip(self._les, self.counts, strict=True):
            acc += count
            out.append((le, float(acc)))
        return out


class LoopHistogram(Collector):
    """``Histogram(name, documentation, labelnames, buckets=..., registry=...)``'s exposition
    with ``observe`` and ``labels`` as the library has them, and no lock."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        if not bounds or bounds[-1] != math.inf:
            bounds += (math.inf,)
        self.name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = bounds
        self._les = tuple(_go_string(b) for b in bounds)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        self._root = None if self._labelnames else HistogramChild(bounds, self._les)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        """The child of one label set (kept: callers on a hot path may hold on to it)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self.name}: expected labels {self._labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self._bounds, self._les)
        return child

    def observe(self, value: float) -> None:
        if self._root is None:
            raise ValueError(f"{self.name} has labels: observe a child from labels()")
        self._root.observe(value)

    def describe(self) -> Iterator[Metric]:
        yield Metric(self.name, self._documentation, "histogram")

    def collect(self) -> Iterator[Metric]:
        # The samples the library's Histogram gives: with a negative bound (the error
        # histograms have them), the count but no sum. HistogramMetricFamily.add_metric would
        # drop the count too.
        metric = Metric(self.name, self._documentation, "histogram")
        children = {(): self._root} if self._root is not None else dict(self._children)
        for values, child in children.items():
            labels = dict(zip(self._labelnames, values, strict=True))
            count = 0.0
            for le, count in child.buckets():
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, count)
            metric.add_sample(self.name + "_count", labels, count)
            if self._bounds[0] >= 0:
                metric.add_sample(self.name + "_sum", labels, child.total)
        yield metric
