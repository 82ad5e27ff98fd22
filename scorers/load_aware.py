"""Load-aware scorer (llm-d's ``load-aware-scorer``): an absolute score from the engine queue.

Unlike ``queue-scorer``, which ranks endpoints against each other (min-max), this one scores
each endpoint on its own: 0.5 with an empty queue, falling linearly to 0 at ``threshold``
waiting requests. Two endpoints with short queues therefore stay close, and the other scorers
(prefix above all) decide between them; only a queue near the threshold outweighs a hit.
An endpoint not scraped yet counts the gateways' own requests waiting there (engine_queue.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.core.strict import Strict
from scorers.engine_queue import engine_waiting


class LoadAwareParameters(Strict):
    threshold: int = Field(128, ge=1)


class LoadAwareScorer:
    type_name = "load-aware-scorer"

    def __init__(self, params: LoadAwareParameters | None = None) -> None:
        self._threshold = float((params or LoadAwareParameters()).threshold)

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        limit = self._threshold
        return [0.5 * (1.0 - min(max(engine_waiting(e), 0.0), limit) / limit) for e in endpoints]
