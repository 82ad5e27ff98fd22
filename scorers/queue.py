"""Queue scorer: fewer requests waiting in the engine's queue is better (min-max scaled).

An endpoint not scraped yet counts the gateways' own requests waiting there (engine_queue.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from scorers.engine_queue import engine_waiting
from scorers.scale import inverted_min_max


class QueueScorer:
    type_name = "queue-scorer"

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        return inverted_min_max([engine_waiting(e) for e in endpoints])
