"""The KV-event subscribers of a pool: one per endpoint with an events address, started,
added and removed as endpoints come and go (router.precise.events holds the subscriber itself)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import zmq.asyncio
from prometheus_client import CollectorRegistry

from router.core.tasks import cancel_and_wait
from router.precise.event_sources import EventSource
from router.precise.events import (
    BatchMirror,
    EndpointSubscriber,
    SubscriberMetrics,
    SubscriberSettings,
)
from router.precise.index import PreciseIndex

log = logging.getLogger("prefixgate.kv_events")


class KVEventsManager:
    """Runs a subscriber per endpoint with an events address; owns their ZMQ context.

    Endpoints may join (:meth:`add`) and leave (:meth:`remove`) while it runs: discovery."""

    def __init__(
        self,
        index: PreciseIndex,
        sources: Iterable[EventSource],
        settings: SubscriberSettings,
        registry: CollectorRegistry,
        mirror: BatchMirror | None = None,
    ) -> None:
        self.index = index
        self._settings = settings
        self._metrics = SubscriberMetrics(registry)
        self._mirror = mirror
        self._ctx = zmq.asyncio.Context()
        self.subscribers: dict[str, EndpointSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False
        for source in sources:
            self.add(source)

    def start(self) -> None:
        self._started = True
        for sub in self.subscribers.values():
            self._spawn(sub)

    def _spawn(self, sub: EndpointSubscriber) -> None:
        loop = asyncio.get_running_loop()
        eid = sub.endpoint_id
        self._tasks[eid] = loop.create_task(self._guarded(sub), name=f"kv-events-{eid}")

    def add(self, source: EventSource) -> bool:
        """Subscribe to one more endpoint (now, if running); False if it already has one."""
        if source.endpoint_id in self.subscribers:
            return False
        sub = EndpointSubscriber(
            source, self.index, self._ctx, self._settings, self._metrics, mirror=self._mirror
        )
        self.subscribers[source.endpoint_id] = sub
        if self._started:
            self._spawn(sub)
        return True

    async def remove(self, endpoint_id: str) -> None:
        """Stop following an endpoint that left the pool (its index entries stay: see forget)."""
        self.subscribers.pop(endpoint_id, None)
        await cancel_and_wait(self._tasks.pop(endpoint_id, None))
        for gauge in (self._metrics.trusted, self._metrics.entries):
            with contextlib.suppress(KeyError):
                gauge.remove(endpoint_id)

    async def _guarded(self, sub: EndpointSubscriber) -> None:
        # A bug in one subscriber must not end event intake for good: restart it, bounded.
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv events %s: subscriber failed; restarting", sub.endpoint_id)
                sub.connected = False
                sub.last_seq = None
                self.index.cleared(sub.endpoint_id)
                sub.distrust("subscriber restarted")  # the index and its gauge alike
                await asyncio.sleep(1.0)

    def expect_events(self, endpoint_id: str, since: float) -> None:
        sub = self.subscribers.get(endpoint_id)
        if sub is not None:
            sub.expect_events(since)

    async def stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        self._started = False
        for task in tasks:
            await cancel_and_wait(task)
        self._ctx.term()
