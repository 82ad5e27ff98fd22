"""No-hit LRU scorer (llm-d's ``no-hit-lru-scorer``): spread new sessions over the pool.

A request is *cold* when no candidate holds any of its prompt blocks (the prefix index) and
its session has no home yet: a new session, whose placement decides where its later turns
find their context. Cold requests score the endpoint that least recently received a cold
request highest (one that never did highest of all), so a burst of new sessions fans out
instead of piling onto whichever endpoint ties best on load. Warm requests score 0.5
everywhere: the prefix and load scorers decide.

The scorer is pure over the request and the snapshots; the order is updated after the pick
(``on_pick``), so the next request of a burst already sees it. The order holds at most
``lruSize`` endpoints (the oldest are forgotten, and count as never used). An endpoint
that leaves the pool is forgotten too (``forget_endpoint``, called as the prefix index's
is): a pod at its address later is a new replica, which no new session has gone to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pydantic import Field

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.core.strict import Strict


class NoHitLRUParameters(Strict):
    lru_size: int = Field(1024, ge=1)


def is_cold(request: RoutingRequest) -> bool:
    """No endpoint holds any of the prompt and the session (if any) has no home."""
    return request.affinity_endpoint is None and not any(request.prefix_hits.values())


class NoHitLRUScorer:
    type_name = "no-hit-lru-scorer"

    def __init__(self, params: NoHitLRUParameters | None = None) -> None:
        self._size = (params or NoHitLRUParameters()).lru_size
        # Endpoint ids, least recently given a cold request first.
        self._used: OrderedDict[str, None] = OrderedDict()

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        n = len(endpoints)
        if not is_cold(request):
            return [0.5] * n
        if n == 1:
            return [1.0]
        used = {endpoint_id: i for i, endpoint_id in enumerate(self._used)}
        never = [e.id for e in endpoints if e.id not in used]
        # Never used first (in the given order), then the least recently used; rank / (n - 1).
        ranked = never + sorted((e.id for e in endpoints if e.id in used), key=used.__getitem__)
        rank = {endpoint_id: i for i, endpoint_id in enumerate(ranked)}
        return [1.0 - rank[e.id] / (n - 1) for e in endpoints]

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None:
        if not is_cold(request):
            return
        self._used[endpoint_id] = None
        self._used.move_to_end(endpoint_id)
        while len(self._used) > self._size:
            self._used.popitem(last=False)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """The endpoint left the pool: back, it counts as never used (async, as the other
        stores' forget hooks are)."""
        self._used.pop(endpoint_id, None)
