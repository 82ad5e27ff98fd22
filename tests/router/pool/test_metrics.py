"""The gateway's own metrics."""

from __future__ import annotations

from router.core.endpoints import EndpointPool
from router.pool.metrics import GatewayMetrics


def test_requests_are_counted_by_endpoint_status_and_api() -> None:
    metrics = GatewayMetrics(EndpointPool())
    for _ in range(3):
        metrics.count_request("e1", 200, "chat")
    metrics.count_request("e1", 429, "chat")
    metrics.count_request("none", 400, "completions")

    def value(endpoint: str, status: str, api: str) -> float | None:
        labels = {"endpoint": endpoint, "status": status, "api": api}
        return metrics.registry.get_sample_value("prefixgate_requests_total", labels)

    assert value("e1", "200", "chat") == 3 and value("e1", "429", "chat") == 1
    assert value("none", "400", "completions") == 1 and value("e1", "400", "chat") is None
