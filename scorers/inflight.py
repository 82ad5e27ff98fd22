"""In-flight scorer: the gateway's own count of requests it has sent to each endpoint.

Counted at pick time, so unlike the scraped queue depth it is never stale: it is what keeps a
burst that arrives between two scrapes from herding onto one endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from scorers.scale import inverted_min_max


class InFlightScorer:
    type_name = "inflight-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        return inverted_min_max([float(e.in_flight) for e in endpoints])
