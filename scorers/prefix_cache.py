"""Prefix-cache scorer: the share of the request's blocks an endpoint probably holds."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


class PrefixCacheScorer:
    """``matched leading blocks / total blocks`` from the prefix index (0 with no blocks)."""

    type_name = "prefix-cache-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        total = len(request.block_hashes)
        if total == 0:
            return [0.0] * len(endpoints)
        hits = request.prefix_hits
        return [hits.get(e.id, 0) / total for e in endpoints]
