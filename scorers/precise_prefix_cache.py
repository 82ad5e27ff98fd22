"""Precise prefix-cache scorer: the share of the request's token blocks each replica holds.

The blocks come from the replicas' own KV events (router.precise.index), matched as the longest
consecutive run of the request's block keys, speculative entries of recent picks included. An
endpoint whose event stream is not trusted, or a request that could not be tokenized, is scored
exactly like ``prefix-cache-scorer`` (the approximate index), so the scorer degrades, never fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


class PreciseScores(Protocol):
    """What the scorers read (router.precise.routing.PreciseTracker provides it)."""

    def scores(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[float] | None: ...

    def held_share(self, serial: int, endpoint_id: str) -> float | None:
        """After ``scores``: the share a trusted endpoint holds; None to use the approximate
        index (untrusted stream, or a request that could not be tokenized)."""
        ...


class PrecisePrefixCacheScorer:
    type_name = "precise-prefix-cache-scorer"

    def __init__(self, source: PreciseScores | None) -> None:
        self._source = source

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        precise = self._source.scores(request, endpoints) if self._source is not None else None
        if precise is not None:
            return precise
        total = len(request.block_hashes)
        if total == 0:
            return [0.0] * len(endpoints)
        hits = request.prefix_hits
        return [hits.get(e.id, 0) / total for e in endpoints]
