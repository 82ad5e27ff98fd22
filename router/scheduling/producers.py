"""Producers and observers that connect the scheduler to the prefix index and affinity store."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest
from router.index.affinity import AffinityStore
from router.index.prefix_index import PrefixIndex


class PrefixTracker:
    """Looks the request's block chain up before scoring; records it for the pick after."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    async def produce(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        if request.block_hashes and endpoints:
            request.prefix_hits = await self.index.match(
                request.block_hashes, [e.id for e in endpoints]
            )
            request.cache_room = {e.id: self.index.room(e.id) for e in endpoints}

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None:
        if request.block_hashes:
            self.index.record(endpoint_id, request.block_hashes)

    def on_unpick(self, request: RoutingRequest, endpoint_id: str) -> None:
        # Only the blocks the pick added: those the lookup found there stay credited.
        if request.block_hashes:
            held = request.prefix_hits.get(endpoint_id, 0)
            self.index.withdraw(endpoint_id, request.block_hashes, held)


class AffinityTracker:
    """Remembers which endpoint served each session last (``x-session-id``)."""

    def __init__(self, store: AffinityStore) -> None:
        self.store = store

    async def produce(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> None:
        if request.session_id:
            request.affinity_endpoint = await self.store.get(request.session_id)

    def on_pick(self, request: RoutingRequest, endpoint_id: str) -> None:
        # A prefill step's endpoint is not the session's home: its decode endpoint is.
        if request.session_id and not request.prefill_step:
            self.store.set(request.session_id, endpoint_id)

    def on_unpick(self, request: RoutingRequest, endpoint_id: str) -> None:
        # The pick served nothing: the session goes back to the endpoint it had when this
        # request was routed (or to none), not pinned to a failing one. A retry that is
        # answered sets it again (on_pick).
        if request.session_id and not request.prefill_step:
            self.store.restore(request.session_id, endpoint_id, request.affinity_endpoint)
