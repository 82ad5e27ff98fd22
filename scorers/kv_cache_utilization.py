"""KV-cache utilization scorer: ``1 - usage``, so endpoints with KV headroom are preferred."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


class KVCacheUtilizationScorer:
    type_name = "kv-cache-utilization-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        return [1.0 - min(1.0, max(0.0, e.kv_usage)) for e in endpoints]
