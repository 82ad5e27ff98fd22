"""The default saturation detector, table-driven."""

from __future__ import annotations

import math

import pytest

from flow_control.config import SaturationDetectorConfig
from flow_control.saturation import (
    DEFAULT_SCRAPE_INTERVAL,
    DEFAULT_SCRAPE_TIMEOUT,
    SaturationDetector,
    ThresholdSaturationDetector,
    default_staleness,
)
from router.config.pool import MetricsScrapeConfig
from router.core.endpoints import EndpointSnapshot

INF = math.inf


def snap(
    in_flight: int = 0, waiting: float = 0.0, kv: float = 0.0, age: float = 0.05, eid: str = "e"
) -> EndpointSnapshot:
    return EndpointSnapshot(
        id=eid,
        url=f"http://{eid}:8000",
        role="both",
        in_flight=in_flight,
        pending_prefill_tokens=0,
        waiting=waiting,
        running=0.0,
        kv_usage=kv,
        metrics_age=age,
    )


DETECTOR = ThresholdSaturationDetector(
    SaturationDetectorConfig(
        queue_depth_threshold=5,
        kv_cache_util_threshold=0.8,
        in_flight_threshold=10,
        metrics_staleness_threshold=0.2,
    )
)


@pytest.mark.parametrize(
    ("endpoint", "saturated"),
    [
        (snap(), False),
        (snap(waiting=4), False),
        (snap(waiting=5), True),
        (snap(kv=0.79), False),
        (snap(kv=0.8), True),
        (snap(in_flight=9), False),
        (snap(in_flight=10), True),
        (snap(age=0.2), False),
        (snap(age=0.21), True),  # stale metrics: cannot see it, treat as full
        (snap(age=INF), False),  # never scraped: judged on in-flight only
        (snap(age=INF, waiting=50, kv=1.0), False),
        (snap(age=INF, in_flight=10), True),
    ],
)
def test_endpoint_thresholds(endpoint: EndpointSnapshot, saturated: bool) -> None:
    assert DETECTOR.endpoint_saturated(endpoint) is saturated
    # Liveness: with nothing of the gateway's in flight there, readings alone hold nothing.
    assert DETECTOR.saturated([endpoint]) is (saturated and endpoint.in_flight > 0)


@pytest.mark.parametrize(
    ("endpoints", "pending", "saturated"),
    [
        ([], 0, True),  # no endpoint can take anything
        # Endpoints over a threshold with none of ours in flight: one request each (liveness).
        ([snap(waiting=9), snap(kv=0.9)], 1, False),
        ([snap(waiting=9), snap(kv=0.9)], 2, True),
        ([snap(waiting=9, in_flight=1), snap(kv=0.9, in_flight=1)], 0, True),
        ([snap(waiting=9), snap(in_flight=3)], 0, False),  # one endpoint with room is enough
        ([snap(age=1.0), snap(age=INF)], 0, False),
        ([snap(age=1.0, in_flight=1), snap(age=INF, in_flight=10)], 0, True),
        ([snap(age=1.0), snap(age=INF, in_flight=10)], 0, False),  # unseen, none of ours
        # Pending (admitted, not yet leased) requests fill the room that is left.
        ([snap(in_flight=7)], 2, False),
        ([snap(in_flight=7)], 3, True),
        ([snap(in_flight=8), snap(in_flight=8, eid="f")], 3, False),
        ([snap(in_flight=8), snap(in_flight=8, eid="f")], 4, True),
        ([snap(in_flight=0), snap(waiting=5, eid="f")], 11, True),
    ],
)
def test_pool_saturation(endpoints: list[EndpointSnapshot], pending: int, saturated: bool) -> None:
    assert DETECTOR.saturated(endpoints, pending) is saturated


def test_default_detector_is_a_saturation_detector() -> None:
    assert isinstance(ThresholdSaturationDetector(), SaturationDetector)


def test_one_slow_scrape_does_not_saturate_by_default() -> None:
    """With the gateway's 100 ms scrape interval, metrics 0.35 s old mean one slow scrape (the
    loop was busy), not an endpoint we cannot see: llm-d's 200 ms would queue everything."""
    detector = ThresholdSaturationDetector()
    assert detector.staleness == default_staleness() == 1.0
    assert not detector.saturated([snap(age=0.35), snap(age=0.35, eid="f")])
    assert detector.saturated([snap(age=1.01, in_flight=1), snap(age=1.5, in_flight=1, eid="f")])


@pytest.mark.parametrize(
    ("interval", "timeout", "expected"),
    [
        (0.1, 0.5, 1.0),  # the floor: two intervals and a timed-out scrape are only 0.7 s
        (0.05, 0.2, 1.0),
        (1.0, 0.5, 2.5),  # a slow scrape cadence is never "stale" between two scrapes
        (2.0, 1.0, 5.0),
    ],
)
def test_staleness_is_derived_from_the_scrape_settings(
    interval: float, timeout: float, expected: float
) -> None:
    assert default_staleness(interval, timeout) == pytest.approx(expected)
    detector = ThresholdSaturationDetector(scrape_interval=interval, scrape_timeout=timeout)
    assert detector.staleness == pytest.approx(expected)
    # Just before the next scrape lands, an endpoint is never stale.
    assert not detector.endpoint_saturated(snap(age=interval + timeout))
    assert detector.endpoint_saturated(snap(age=expected + 0.01))


def test_configured_staleness_overrides_the_derived_one() -> None:
    cfg = SaturationDetectorConfig(metrics_staleness_threshold=0.3)
    detector = ThresholdSaturationDetector(cfg, scrape_interval=2.0, scrape_timeout=1.0)
    assert detector.staleness == 0.3


def test_scrape_defaults_match_the_gateway_config() -> None:
    scrape = MetricsScrapeConfig()
    assert (scrape.interval_seconds, scrape.timeout_seconds) == (
        DEFAULT_SCRAPE_INTERVAL,
        DEFAULT_SCRAPE_TIMEOUT,
    )
