"""Everything precise routing owns, built from the config and started with the gateway.

:class:`PreciseRuntime` holds the index (local, and shared through Redis when so configured),
the tokenizer, the tracker that connects them to the scheduler (router/precise/routing.py), and
the KV event subscribers, which follow the pool's joins and leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from router.config.model import GatewayConfig
from router.config.precise import TokenizerConfig
from router.core.endpoints import Endpoint
from router.index.redis_link import RedisMetrics
from router.precise.events import EventSource, SubscriberSettings, derive_sources
from router.precise.events_manager import KVEventsManager
from router.precise.hf_tokenizer import huggingface_tokenizer
from router.precise.index import PreciseIndex
from router.precise.routing import PreciseSettings, PreciseTracker
from router.precise.shared_index import SharedPreciseIndex
from router.precise.tokenizers import CachingTokenizer, RemoteTokenizer, Tokenizer, sim_tokenizer

log = logging.getLogger("prefixgate.precise")


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    inner: Tokenizer
    if cfg.type == "sim":
        inner = sim_tokenizer(cfg.thread_above_bytes)
    elif cfg.type == "huggingface":
        assert cfg.path is not None  # enforced by the config model
        inner = huggingface_tokenizer(
            cfg.path, cfg.chat_template, cfg.add_special_tokens, cfg.thread_above_bytes
        )
    else:
        inner = RemoteTokenizer(cfg.timeout_ms / 1000.0)
    return CachingTokenizer(inner, cfg.timeout_ms / 1000.0, cfg.cache_entries)


class PreciseRuntime:
    """Everything precise routing owns: index (local, and shared when so configured),
    tokenizer, tracker, and the event subscribers, which follow the pool's joins and leaves."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: CollectorRegistry,
        redis_metrics: RedisMetrics | None = None,
    ) -> None:
        pp = config.precise_prefix
        self._config = config
        self._registry = registry
        self.index = PreciseIndex(pp.block_size, pp.max_blocks_per_endpoint)
        self.shared: SharedPreciseIndex | None = None
        ic = pp.index
        if ic.backend == "redis" and ic.url is not None:
            self.shared = SharedPreciseIndex(
                self.index, ic.url, namespace=ic.namespace, timeout_ms=ic.timeout_ms,
                metrics=redis_metrics or RedisMetrics(registry),
                resync_seconds=pp.kv_events.resync_seconds, registry=registry,
                cluster=ic.cluster,
            )
        self.tracker = PreciseTracker(
            self.index,
            build_tokenizer(pp.tokenizer),
            PreciseSettings(pp),
            shared=self.shared,
        )
        self.events: KVEventsManager | None = None
        self._joined: dict[str, str] = {}  # endpoints that joined before start

    def sources(self, endpoint_urls: Mapping[str, str]) -> list[EventSource]:
        ev = self._config.precise_prefix.kv_events
        return derive_sources(
            endpoint_urls,
            {eid: e.address for eid, e in ev.endpoints.items()},
            {eid: e.replay_address for eid, e in ev.endpoints.items() if e.replay_address},
            ev.port, ev.port_offset, ev.replay_port, ev.replay_port_offset,
        )

    def start(self, endpoint_urls: Mapping[str, str]) -> None:
        """Subscribe to every endpoint that has an events address (needs a running loop)."""
        ev = self._config.precise_prefix.kv_events
        settings = SubscriberSettings(ev)
        sources = self.sources({**self._joined, **endpoint_urls})
        self._joined.clear()
        if not sources and self._config.discovery is None:
            log.warning("precise prefix routing has no KV events address for any endpoint; "
                        "every endpoint is scored from the approximate index")
        self.events = KVEventsManager(
            self.index, sources, settings, self._registry, mirror=self.shared
        )
        self.events.start()

    def endpoint_joined(self, endpoint: Endpoint) -> None:
        """A discovered endpoint: follow its events from now on (router.pool.discovery.LivePool)."""
        if self.events is None:
            self._joined[endpoint.id] = endpoint.url
            return
        for source in self.sources({endpoint.id: endpoint.url}):
            if self.events.add(source):
                log.info("kv events %s: subscribing to %s", source.endpoint_id, source.address)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        """An endpoint left for good: stop following it and purge its entries (Redis too)."""
        self._joined.pop(endpoint_id, None)
        if self.events is not None:
            await self.events.remove(endpoint_id)
        if self.shared is not None:
            await self.shared.forget_endpoint(endpoint_id)
        else:
            self.index.forget(endpoint_id)

    def expect_events(self, endpoint_id: str, since: float) -> None:
        if self.events is not None:
            self.events.expect_events(endpoint_id, since)

    def set_capacity(self, endpoint_id: str, num_gpu_blocks: int) -> None:
        # A consistent stream never holds more than the cache's blocks; a little slack.
        self.index.set_capacity(endpoint_id, num_gpu_blocks + 64)

    async def stop(self) -> None:
        if self.events is not None:
            await self.events.stop()
            self.events = None
        if self.shared is not None:
            await self.shared.aclose()
        await self.tracker.tokenizer.aclose()
