"""Flow control's Prometheus metrics, on a registry the gateway owns.

Flow labels come from a client-set header, so their number is capped: the first
``max_flow_labels`` fairness ids get their own label, later ones are summed under "other".
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flow_control.limits import ConcurrencyLimits

OTHER = "other"
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_MAX_MODEL_LABELS = 256


class FlowControlMetrics:
    def __init__(self, registry: CollectorRegistry, max_flow_labels: int = 100) -> None:
        self._max_flow_labels = max_flow_labels
        self._flow_labels: set[str] = set()
        self._saturated_children: dict[str, Gauge] = {}
        self._registry = registry
        r = registry
        self.queue_requests = Gauge(
            "prefixgate_flow_queue_requests", "Requests queued, by band.", ["band"], registry=r
        )
        self.queue_bytes = Gauge(
            "prefixgate_flow_queue_bytes", "Bytes of queued requests, by band.", ["band"],
            registry=r,
        )
        self.flow_requests = Gauge(
            "prefixgate_flow_queue_flow_requests",
            "Requests queued, by flow (fairness id, capped; the rest as 'other') and priority.",
            ["flow", "priority"],
            registry=r,
        )
        self.flow_bytes = Gauge(
            "prefixgate_flow_queue_flow_bytes",
            "Bytes of queued requests, by flow (capped as above) and priority.",
            ["flow", "priority"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "prefixgate_flow_queue_wait_seconds",
            "Time from joining the queue to dispatch (0 for those let through at once), by band.",
            ["band"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.dispatches = Counter(
            "prefixgate_flow_dispatches",
            "Requests let through, by band and path (fast: no wait; queued).",
            ["band", "path"],
            registry=r,
        )
        self.rejections = Counter(
            "prefixgate_flow_rejections",
            "Requests refused or dropped by flow control, by reason.",
            ["reason"],
            registry=r,
        )
        self.pool_saturated = Gauge(
            "prefixgate_flow_pool_saturated",
            "1 while the pool serving the model is saturated.",
            ["model"],
            registry=r,
        )

    def watch_limits(self, limits: ConcurrencyLimits) -> None:
        """Export each endpoint's learned limit, read at scrape time (no per-request work)."""
        self._registry.register(_LimitCollector(limits))

    def flow_label(self, fairness_id: str) -> str:
        if fairness_id in self._flow_labels:
            return fairness_id
        if len(self._flow_labels) < self._max_flow_labels:
            self._flow_labels.add(fairness_id)
            return fairness_id
        return OTHER

    def flow_gauges(self, fairness_id: str, priority: int) -> tuple[Gauge, Gauge]:
        labels = (self.flow_label(fairness_id), str(priority))
        return self.flow_requests.labels(*labels), self.flow_bytes.labels(*labels)

    def set_saturated(self, model: str, saturated: bool) -> None:
        child = self._saturated_children.get(model)
        if child is None:
            if len(self._saturated_children) >= _MAX_MODEL_LABELS:
                return  # unreachable with a sane pool; never grow without bound
            child = self.pool_saturated.labels(model)
            self._saturated_children[model] = child
        child.set(1 if saturated else 0)


class _LimitCollector(Collector):
    def __init__(self, limits: ConcurrencyLimits) -> None:
        self._limits = limits

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "prefixgate_flow_concurrency_limit",
            "Learned limit on this gateway's requests waiting for a first byte, by endpoint.",
            labels=["endpoint"],
        )
        for endpoint_id, limit in self._limits.items():
            family.add_metric([endpoint_id], limit)
        yield family
