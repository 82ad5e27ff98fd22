"""Session-affinity scorer: 1 for the endpoint that served this ``x-session-id`` last."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


class SessionAffinityScorer:
    type_name = "session-affinity-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        home = request.affinity_endpoint
        return [1.0 if home is not None and e.id == home else 0.0 for e in endpoints]
