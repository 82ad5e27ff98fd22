"""What the gateway remembers between requests: the prefix index, session affinity and, with
several gateway replicas, their shared in-flight counts. Built from ``prefixIndex`` config:
in memory by default, in Redis (shared by every replica) with ``backend: redis``, or in each
process's memory with writes replicated through Redis with ``backend: replicated``
(router/index/replicated.py; the workers of ``serve --workers N``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router.config.model import GatewayConfig
from router.core.endpoints import EndpointSnapshot
from router.core.pool import EndpointPool
from router.index.affinity import AffinityStore, InMemoryAffinityStore
from router.index.prefix_index import DEFAULT_CAPACITY_BLOCKS, InMemoryPrefixIndex, PrefixIndex
from router.index.redis_index import RedisPrefixIndex
from router.index.redis_link import RedisMetrics
from router.index.redis_state import RedisAffinityStore, SharedInFlight, gateway_load
from router.index.replicated import ReplicatedAffinityStore, ReplicatedPrefixIndex, Replicator
from router.index.response_store import Probe, ResponseRoutes

Candidates = Callable[[str], list[EndpointSnapshot]]


@dataclass(slots=True)
class Stores:
    index: PrefixIndex
    affinity: AffinityStore
    shared_in_flight: SharedInFlight | None = None
    # Responses API: which endpoint stored each response.
    responses: ResponseRoutes = dataclasses.field(default_factory=ResponseRoutes)
    # The Redis metrics, registered once, for other Redis users (the shared precise index).
    redis_metrics: RedisMetrics | None = None
    # backend: replicated: carries the index's and affinity's writes to the other processes.
    replicator: Replicator | None = None

    def candidates(self, pool: EndpointPool) -> Candidates:
        """The pool's candidates, with the other gateway replicas' load added (in flight, and
        the prefill they have queued)."""
        shared = self.shared_in_flight
        if shared is None:
            return pool.candidates

        remote = shared.remote_load

        def with_remote(model: str) -> list[EndpointSnapshot]:
            return pool.candidates(model, remote)

        return with_remote

    def start(self) -> None:
        if self.shared_in_flight is not None:
            self.shared_in_flight.start()
        if self.replicator is not None:
            self.replicator.start()

    async def aclose(self) -> None:
        if self.shared_in_flight is not None:
            await self.shared_in_flight.aclose()
        if self.replicator is not None:
            await self.replicator.aclose()
        closer = getattr(self.affinity, "aclose", None)
        if closer is not None:
            await closer()
        await self.responses.aclose()
        await self.index.aclose()


def build_stores(
    config: GatewayConfig,
    pool: EndpointPool,
    registry: CollectorRegistry,
    probe: Probe | None = None,
) -> Stores:
    """The index, the session store and the response routes the config asks for; ``probe``
    finds a stored response on the endpoints when no map knows it."""
    cfg = config.prefix_index
    sessions = config.session_affinity
    capacity = cfg.capacity_blocks or DEFAULT_CAPACITY_BLOCKS
    if cfg.backend == "memory" or cfg.url is None:
        return Stores(
            InMemoryPrefixIndex(capacity),
            InMemoryAffinityStore(sessions.ttl_seconds, sessions.max_sessions),
            responses=_response_routes(config, probe),
        )
    metrics = RedisMetrics(registry)
    url, namespace, budget = cfg.url, cfg.namespace, cfg.timeout_ms
    shared = SharedInFlight(
        url,
        lambda: gateway_load(pool),
        namespace=namespace,
        timeout_ms=budget,
        metrics=metrics,
        cluster=cfg.cluster,
    )
    responses = _response_routes(config, probe, metrics)
    if cfg.backend == "replicated":
        replicator = Replicator(url, namespace, metrics)
        return Stores(
            ReplicatedPrefixIndex(InMemoryPrefixIndex(capacity), replicator),
            ReplicatedAffinityStore(
                InMemoryAffinityStore(sessions.ttl_seconds, sessions.max_sessions), replicator
            ),
            shared, responses, metrics, replicator,
        )
    index = RedisPrefixIndex(
        url, namespace=namespace, timeout_ms=budget, metrics=metrics, default_capacity=capacity,
        max_blocks_per_write=cfg.max_blocks_per_write, cluster=cfg.cluster,
    )
    affinity = RedisAffinityStore(
        url,
        namespace=namespace,
        timeout_ms=budget,
        metrics=metrics,
        ttl_seconds=sessions.ttl_seconds,
        max_sessions=sessions.max_sessions,
        cluster=cfg.cluster,
    )
    return Stores(index, affinity, shared, responses, metrics)


def _response_routes(
    config: GatewayConfig, probe: Probe | None, metrics: RedisMetrics | None = None
) -> ResponseRoutes:
    """Where stored responses live: in memory, or in the Redis of the index (with ``metrics``)."""
    rc, cfg = config.responses, config.prefix_index
    if metrics is None or cfg.url is None:
        return ResponseRoutes(
            rc.ttl_seconds, rc.max_entries, probe_timeout_seconds=rc.probe_timeout_seconds,
            probe=probe,
        )
    return ResponseRoutes(
        rc.ttl_seconds,
        rc.max_entries,
        url=cfg.url,
        namespace=cfg.namespace,
        timeout_ms=rc.redis_timeout_ms,
        probe_timeout_seconds=rc.probe_timeout_seconds,
        probe=probe,
        metrics=metrics,
        cluster=cfg.cluster,
    )
