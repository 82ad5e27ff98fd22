"""Endpoint snapshots and precise-score sources for scorer and scheduling tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest


def snap(eid: str, **kw: Any) -> EndpointSnapshot:
    """An idle endpoint ``eid`` with fresh metrics; ``kw`` overrides any field."""
    base: dict[str, Any] = {
        "id": eid,
        "url": f"http://{eid}",
        "role": "both",
        "in_flight": 0,
        "pending_prefill_tokens": 0,
        "waiting": 0.0,
        "running": 0.0,
        "kv_usage": 0.0,
        "metrics_age": 0.0,
    }
    base.update(kw)
    return EndpointSnapshot(**base)


class FixedScores:
    """A precise-score source that answers the same values (or None: not tokenized)."""

    def __init__(self, values: list[float] | None) -> None:
        self.values = values
        self._shares: dict[tuple[int, str], float] = {}

    def scores(
        self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]
    ) -> list[float] | None:
        if self.values is not None:
            for e, v in zip(endpoints, self.values, strict=True):
                self._shares[request.serial, e.id] = v
        return self.values

    def held_share(self, serial: int, endpoint_id: str) -> float | None:
        return self._shares.get((serial, endpoint_id))
