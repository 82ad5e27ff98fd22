"""The endpoint picker's own metrics (the routing metrics are the gateway's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ExtProcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "prefixgate_extproc_decisions",
            "Endpoint picker answers: routed, routed without a body, rejected (shed or no "
            "endpoint), invalid (4xx) or error.",
            ["outcome"],
            registry=registry,
        )
        self.streams = Gauge(
            "prefixgate_extproc_streams",
            "Open ext_proc streams (HTTP requests in flight).",
            registry=registry,
        )
