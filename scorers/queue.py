"""Queue scorer: fewer requests waiting in the engine's queue is better (min-max scaled)."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from scorers.scale import inverted_min_max


class QueueScorer:
    type_name = "queue-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        return inverted_min_max([e.waiting for e in endpoints])
