"""Is the pool for a model saturated? A pure function of endpoint snapshots.

An endpoint is saturated when it is at or over any threshold (engine waiting queue, KV cache
usage, the gateway's in-flight count) or its metrics are stale: a replica we cannot see is
treated as full, as llm-d does. The pool is saturated when every endpoint is.

An endpoint whose metrics were *never* scraped (``metrics_age == inf``: a backend without
``/metrics``) is judged on the gateway's in-flight count only. Treating it as stale would
saturate such a pool forever, and the in-flight count is exact for a backend only we use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from flow_control.config import SaturationDetectorConfig
from router.endpoints import EndpointSnapshot


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

    def __init__(self, config: SaturationDetectorConfig | None = None) -> None:
        cfg = config or SaturationDetectorConfig()
        self.queue_depth = cfg.queue_depth_threshold
        self.kv_usage = cfg.kv_cache_util_threshold
        self.in_flight = cfg.in_flight_threshold
        self.staleness = cfg.metrics_staleness_threshold

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
                if room > pending:
                    return False
        return True
