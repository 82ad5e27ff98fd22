"""Session-hash scorer: a stable hash of the session (or prompt head) picks a home endpoint.

A baseline for comparisons: pure affinity, no prefix or load signal beyond a bound. Rendezvous
hashing, so an endpoint leaving the pool moves only its own sessions; with bounded loads
(consistent hashing with bounded loads, Mirrokni et al.), so a handful of sessions that hash
to one endpoint cannot pile up there: a request goes to the first endpoint in its hash order
whose in-flight count is under ``(1 + epsilon)`` times the pool's average (this request
included). With few sessions per endpoint, plain hashing leaves some endpoints with twice the
average and others idle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from router.core.endpoints import EndpointSnapshot
from router.core.framework import RoutingRequest

# How far above the average load an endpoint may go before its sessions spill to the next one.
DEFAULT_EPSILON = 0.25


class SessionHashScorer:
    type_name = "session-hash-scorer"

    def __init__(self, epsilon: float = DEFAULT_EPSILON) -> None:
        self._epsilon = epsilon

    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        if not endpoints:
            return []
        if request.session_id:
            key = request.session_id.encode()
        elif request.block_hashes:
            key = request.block_hashes[0].to_bytes(8, "little")
        else:
            return [0.0] * len(endpoints)
        weights = [xxhash.xxh64_intdigest(key, seed=_seed(e.id)) for e in endpoints]
        order = sorted(range(len(endpoints)), key=lambda i: weights[i], reverse=True)
        total = sum(e.in_flight for e in endpoints) + 1
        bound = math.ceil((1.0 + self._epsilon) * total / max(1, len(endpoints)))
        home = next((i for i in order if endpoints[i].in_flight < bound), order[0])
        return [1.0 if i == home else 0.0 for i in range(len(endpoints))]


def _seed(endpoint_id: str) -> int:
    return xxhash.xxh64_intdigest(endpoint_id.encode())
