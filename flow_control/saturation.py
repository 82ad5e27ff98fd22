"""Is the pool for a model saturated? A pure function of endpoint snapshots.

An endpoint is saturated when it is at or over any threshold (engine waiting queue, KV cache
usage, the gateway's in-flight count) or its metrics are stale: a replica we cannot see is
treated as full, as llm-d does. The pool is saturated when every endpoint is, except that an
endpoint with nothing of the gateways' in flight (this one's, and others' sharing Redis)
always has room for one request, whatever its readings say or however old they are (a
replica whose ``/metrics`` fails while it serves would otherwise be held for good).

How old is "stale"? Not llm-d's 200 ms (see :func:`default_staleness`): by default the
threshold is derived from the gateway's scrape settings so that only a missed scrape cycle,
never one slow scrape, makes an endpoint look full.

An endpoint whose metrics were *never* scraped (``metrics_age == inf``: a backend without
``/metrics``) is judged on the gateway's in-flight count only. Treating it as stale would
saturate such a pool forever, and the in-flight count is exact for a backend only we use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from flow_control.config import SaturationDetectorConfig
from router.core.endpoints import EndpointSnapshot

# The gateway's scrape defaults (pool.metricsScrape; a test keeps them equal). Not imported:
# router.config.model imports this package's config, so importing it back would be a cycle.
DEFAULT_SCRAPE_INTERVAL = 0.1
DEFAULT_SCRAPE_TIMEOUT = 0.5
MIN_STALENESS_SECONDS = 1.0


def default_staleness(
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
    scrape_timeout: float = DEFAULT_SCRAPE_TIMEOUT,
) -> float:
    """Metrics age at which an endpoint counts as unseen: a whole scrape cycle was missed.

    Each endpoint's scraper sleeps ``scrape_interval`` after a scrape lands, so even when all
    is well the metrics are ``interval + scrape latency`` old just before the next one lands.
    Under load that latency is large and correlated: the replica answers /metrics from the
    loop its engine runs on, and the gateway reads every endpoint's answer on the one loop
    that is busy proxying. With llm-d's 200 ms and a 100 ms interval, a 100 ms hiccup marks
    every healthy endpoint saturated at once, so everything queues exactly when the gateway
    is busiest, which makes it busier still.

    A staleness guard only has to cover the gap until health checking reacts: a scrape that
    fails (connect error, or ``scrape_timeout``) counts towards the unhealthy threshold and
    takes the endpoint out of the pool, and the gateway's in-flight threshold bounds what is
    sent to an endpoint meanwhile, fresh metrics or not. So the threshold is two intervals
    plus one timed-out scrape (0.7 s with the defaults), and never below one second. It
    scales with the interval: with a 2 s interval a fixed 200 ms would saturate the pool for
    90% of every cycle.
    """
    return max(MIN_STALENESS_SECONDS, 2 * scrape_interval + scrape_timeout)


@runtime_checkable
class SaturationDetector(Protocol):
    def saturated(self, endpoints: Sequence[EndpointSnapshot], pending: int = 0) -> bool:
        """True when the pool can take no more work now.

        ``pending`` counts requests already let through to this pool whose endpoint leases
        are not in any snapshot's ``in_flight`` yet (they are still being scheduled); without
        it a burst admitted between two leases would all pass. An empty pool is saturated.
        """
        ...


class ThresholdSaturationDetector:
    """The default detector: llm-d's thresholds plus the gateway's in-flight count."""

    def __init__(
        self,
        config: SaturationDetectorConfig | None = None,
        *,
        scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
        scrape_timeout: float = DEFAULT_SCRAPE_TIMEOUT,
    ) -> None:
        cfg = config or SaturationDetectorConfig()
        self.queue_depth = cfg.queue_depth_threshold
        self.kv_usage = cfg.kv_cache_util_threshold
        self.in_flight = cfg.in_flight_threshold
        configured = cfg.metrics_staleness_threshold
        self.staleness = (
            configured
            if configured is not None
            else default_staleness(scrape_interval, scrape_timeout)
        )

    def endpoint_saturated(self, endpoint: EndpointSnapshot) -> bool:
        if endpoint.in_flight >= self.in_flight:
            return True
        if math.isinf(endpoint.metrics_age):
            return False  # never scraped: in-flight only (see the module docstring)
        if endpoint.metrics_age > self.staleness:
            return True
        return endpoint.waiting >= self.queue_depth or endpoint.kv_usage >= self.kv_usage

    def saturated(self, endpoints: Sequence[EndpointSnapshot], pending: int = 0) -> bool:
        # Pending requests are assumed to land on the endpoints that still have room, up to
        # the in-flight threshold, as a load-aware scheduler would place them.
        room = 0
        for endpoint in endpoints:
            if not self.endpoint_saturated(endpoint):
                room += self.in_flight - endpoint.in_flight
            elif endpoint.in_flight == 0:
                room += 1  # liveness: readings alone never hold one with no gateway's request
            if room > pending:
                return False
        return True
