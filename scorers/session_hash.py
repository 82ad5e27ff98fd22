"""Session-hash scorer: a stable hash of the session (or prompt head) picks a home endpoint.

A baseline for comparisons: pure affinity, no prefix or load signal. It uses rendezvous
hashing, so an endpoint leaving the pool moves only its own sessions.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from router.endpoints import EndpointSnapshot
from router.scheduling import RoutingRequest


class SessionHashScorer:
    def score(self, request: RoutingRequest, endpoints: Sequence[EndpointSnapshot]) -> list[float]:
        if request.session_id:
            key = request.session_id.encode()
        elif request.block_hashes:
            key = request.block_hashes[0].to_bytes(8, "little")
        else:
            return [0.0] * len(endpoints)
        weights = [xxhash.xxh64_intdigest(key, seed=_seed(e.id)) for e in endpoints]
        best = max(weights)
        return [1.0 if w == best else 0.0 for w in weights]


def _seed(endpoint_id: str) -> int:
    return xxhash.xxh64_intdigest(endpoint_id.encode())
