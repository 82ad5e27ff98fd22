"""The engine queue the load scorers read (``queue-scorer``, ``load-aware-scorer``)."""

from __future__ import annotations

import math

from router.core.endpoints import EndpointSnapshot


def engine_waiting(endpoint: EndpointSnapshot) -> float:
    """Requests waiting in the endpoint's engine: the scraped count, or, for an endpoint never
    scraped (a pod that just joined, a backend without ``/metrics``), the gateways' own
    requests there still waiting for a first byte.

    Flow control judges such an endpoint on the gateways' counts too (exact for a backend only
    they use). Read as an empty queue instead, a backend without ``/metrics`` scored idle
    however many requests waited there; a pod that just joined still scores as idle as it is.
    """
    if math.isinf(endpoint.metrics_age):
        return float(endpoint.pending_prefill_requests)
    return endpoint.waiting
