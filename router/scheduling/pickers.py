"""Pickers: turn weighted totals into an ordered list of endpoints (pick first, then fallbacks)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


class MaxScorePicker:
    """Highest total first; ties broken at random so equal endpoints share a burst."""

    type_name = "max-score-picker"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self,
        request: RoutingRequest,
        endpoints: Sequence[EndpointSnapshot],
        scores: Sequence[float],
    ) -> list[EndpointSnapshot]:
        order = list(range(len(endpoints)))
        self._rng.shuffle(order)
        # Round away float noise so that "equal" totals really tie.
        order.sort(key=lambda i: -round(scores[i], 9))
        return [endpoints[i] for i in order]


class RandomPicker:
    type_name = "random-picker"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self,
        request: RoutingRequest,
        endpoints: Sequence[EndpointSnapshot],
        scores: Sequence[float],
    ) -> list[EndpointSnapshot]:
        ranked = list(endpoints)
        self._rng.shuffle(ranked)
        return ranked


class RoundRobinPicker:
    """Cycles through the candidates in a stable (id) order, ignoring scores."""

    type_name = "round-robin-picker"

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self,
        request: RoutingRequest,
        endpoints: Sequence[EndpointSnapshot],
        scores: Sequence[float],
    ) -> list[EndpointSnapshot]:
        if not endpoints:
            return []
        ordered = sorted(endpoints, key=lambda e: e.id)
        start = self._next % len(ordered)
        self._next += 1
        return ordered[start:] + ordered[:start]
