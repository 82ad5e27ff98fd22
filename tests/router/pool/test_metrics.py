"""The gateway's own metrics."""

from __future__ import annotations

from router.core.endpoints import Endpoint
from router.core.pool import EndpointPool
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


def test_an_endpoint_that_left_the_pool_leaves_its_gauges() -> None:
    pool = EndpointPool([Endpoint.from_url("http://a:8000"), Endpoint.from_url("http://b:8000")])
    for state in pool:
        state.healthy = True
    metrics = GatewayMetrics(pool)
    metrics.render()
    pool.remove("b:8000")
    text = metrics.render().decode()
    assert 'prefixgate_endpoint_healthy{endpoint="a:8000"} 1.0' in text
    assert 'endpoint="b:8000"' not in text


def test_an_endpoint_that_left_the_pool_leaves_its_counters() -> None:
    """Pods come and go under new addresses: their per-endpoint series (and the cached
    children) would pile up for the gateway's lifetime, on every /metrics page."""
    pool = EndpointPool([Endpoint.from_url("http://a:8000"), Endpoint.from_url("http://b:8000")])
    metrics = GatewayMetrics(pool)
    for eid in ("a:8000", "b:8000"):
        metrics.count_request(eid, 200, "chat")
        metrics.upstream_failures.labels(eid, "timeout").inc()
        metrics.stream_errors.labels(eid).inc()
    metrics.count_request("none", 503, "chat")
    metrics.render()
    pool.remove("b:8000")
    text = metrics.render().decode()
    assert 'endpoint="b:8000"' not in text
    metrics.count_request("b:8000", 200, "chat")  # a stream that was still draining there
    metrics.stream_errors.labels("b:8000").inc()
    text = metrics.render().decode()
    assert 'endpoint="b:8000"' not in text
    assert all(key[0] != "b:8000" for key in metrics._request_children)
    for series in (
        'prefixgate_requests_total{api="chat",endpoint="a:8000",status="200"} 1.0',
        'prefixgate_requests_total{api="chat",endpoint="none",status="503"} 1.0',
        'prefixgate_upstream_failures_total{endpoint="a:8000",kind="timeout"} 1.0',
        'prefixgate_stream_errors_total{endpoint="a:8000"} 1.0',
    ):
        assert series in text
