"""The waiting room: every queued request of every model, in the structures of
flow_control/queues.py, with the totals the queue limits read and a heap of deadlines for the
TTL sweep.

It decides who waits and who is pushed out when the queues are full; the controller decides
when a request leaves (dispatch). Requests leave through :meth:`WaitingRoom.unlink` and, when
refused, :meth:`WaitingRoom.fail` (a whole model's queue: :meth:`WaitingRoom.pool_empty`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Literal

from flow_control.config import FlowControlConfig
from flow_control.metrics import FlowControlMetrics
from flow_control.queues import BandState, FlowQueue, Level, ModelQueue, QueueItem, pick_victim
from flow_control.request import FlowRequest, Ticket
from router.core.errors import NoEndpointsError, SaturatedError, TTLExpiredError

Failure = Literal["ttl-expired", "evicted", "shutdown"]
_FAILURES = {
    "evicted": "flow control queues are full and this tenant holds the most queued requests",
    "shutdown": "the gateway is shutting down",
}


class WaitingRoom:
    def __init__(
        self,
        config: FlowControlConfig,
        metrics: FlowControlMetrics,
        ttl: Callable[[str | None], float],
    ) -> None:
        # ttl: an objective's time to live in the queue, in seconds.
        self._config = config
        self._metrics = metrics
        self._ttl = ttl
        self.queues: dict[str, ModelQueue] = {}
        self._deadlines: list[tuple[float, int, QueueItem]] = []
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0

    def max_priority(self, model: str) -> int | None:
        queue = self.queues.get(model)
        return queue.max_priority() if queue is not None else None

    def enqueue(self, request: FlowRequest, band: BandState, now: float) -> QueueItem:
        """Queue ``request``, pushing others out if the queues are full (SaturatedError when
        it is the one to refuse)."""
        size = max(0, request.size)
        self._make_room(request, band, size)
        arrival = request.arrival if request.arrival is not None else now
        deadline = arrival + self._ttl(request.objective)
        queue = self.queues.get(request.model)
        if queue is None:
            queue = self.queues[request.model] = ModelQueue()
        level = queue.levels.get(request.priority)
        if level is None:
            level = queue.levels[request.priority] = Level(request.priority, band)
        flow = level.flows.get(request.fairness_id)
        if flow is None:
            gauges = self._metrics.flow_gauges(request.fairness_id, request.priority)
            flow = FlowQueue(request.fairness_id, request.priority, *gauges)
            level.flows[request.fairness_id] = flow
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        item = QueueItem(request, next(self._seq), now, deadline, future, level, flow)
        flow.items[item.seq] = item
        self._account(item, size, +1)
        queue.count += 1
        heapq.heappush(self._deadlines, (deadline, item.seq, item))
        if len(self._deadlines) > 2 * self.count + 64:
            # Dispatched and cancelled items stay in the heap until popped: compact it so
            # that it stays bounded by what is queued.
            self._deadlines = [e for e in self._deadlines if e[2].queued]
            heapq.heapify(self._deadlines)
        return item

    def _make_room(self, request: FlowRequest, band: BandState, size: int) -> None:
        """Push out queued requests (see ``pick_victim``) until ``request`` fits, or shed it."""
        cfg, limits = self._config, band.limits
        too_big = size > limits.max_bytes or size > cfg.max_bytes
        # Chosen first, pushed out only once they are known to make room: pushing out some
        # and then refusing the newcomer anyway would drop them for nothing.
        victims: list[QueueItem] = []
        count, nbytes, band_count, band_bytes = self.count, self.bytes, band.count, band.bytes
        while True:
            band_full = band_count >= limits.max_requests or band_bytes + size > limits.max_bytes
            global_full = count >= cfg.max_requests or nbytes + size > cfg.max_bytes
            if not band_full and not global_full:
                break
            victim = None if too_big else pick_victim(
                self.queues.values(), request, band if band_full else None, victims
            )
            if victim is None:
                full = f"queue of band {band.name!r} is" if band_full else "queues are"
                self._metrics.rejections.labels("queue-full").inc()
                raise SaturatedError(
                    f"flow control {full} full", retry_after=cfg.retry_after_seconds
                )
            victims.append(victim)
            freed = max(0, victim.request.size)
            count, nbytes = count - 1, nbytes - freed
            if victim.level.band is band:
                band_count, band_bytes = band_count - 1, band_bytes - freed
        for victim in victims:
            self.unlink(victim, rotate=False)
            self.fail(victim, "evicted")

    def _account(self, item: QueueItem, size: int, sign: int) -> None:
        flow, band = item.flow, item.level.band
        flow.bytes += sign * size
        band.count += sign
        band.bytes += sign * size
        self.count += sign
        self.bytes += sign * size
        flow.gauge_requests.inc(sign)
        flow.gauge_bytes.inc(sign * size)
        band.gauge_requests.inc(sign)
        band.gauge_bytes.inc(sign * size)

    def unlink(self, item: QueueItem, rotate: bool) -> None:
        """Take a queued item out, dropping every structure that empties (``rotate``: it is
        dispatched, so the band's fairness policy hears of it)."""
        item.queued = False
        flow, level = item.flow, item.level
        del flow.items[item.seq]
        self._account(item, max(0, item.request.size), -1)
        queue = self.queues[item.request.model]
        queue.count -= 1
        if rotate:
            level.band.policy.dispatched(level.flows, flow, item.request)
        if not flow.items:
            del level.flows[flow.fairness_id]
        if not level.flows:
            del queue.levels[level.priority]
        if not queue.levels:
            del self.queues[item.request.model]

    async def wait(self, item: QueueItem) -> Ticket:
        """The ticket ``item`` is dispatched with; cancelled, it just leaves its queue."""
        try:
            return await item.future
        except asyncio.CancelledError:
            if item.queued:
                self.unlink(item, rotate=False)
                self._metrics.rejections.labels("cancelled").inc()
            elif (
                item.future.done()
                and not item.future.cancelled()
                and item.future.exception() is None
            ):
                # Dispatched just before the cancel arrived: give the slot back.
                item.future.result().release()
            raise

    def expire(self, now: float) -> int:
        """Reject queued requests whose TTL has passed; returns how many."""
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            item = heapq.heappop(self._deadlines)[2]
            if item.queued:
                self.unlink(item, rotate=False)
                self.fail(item, "ttl-expired")
                expired += 1
        return expired

    def fail(self, item: QueueItem, reason: Failure) -> None:
        """Answer an item taken out of its queue with the error for ``reason``."""
        self._metrics.rejections.labels(reason).inc()
        if item.future.done():
            return
        retry = self._config.retry_after_seconds
        if reason == "ttl-expired":
            ttl = self._ttl(item.request.objective)
            message = f"request waited longer than its TTL of {ttl:g}s in the flow control queue"
            item.future.set_exception(TTLExpiredError(message, retry_after=retry))
        else:
            item.future.set_exception(SaturatedError(_FAILURES[reason], retry_after=retry))

    def pool_empty(self, model: str, now: float, grace: float) -> int:
        """``model``'s pool has no endpoint while requests wait for it. One arriving now is
        answered NoEndpointsError at once; the queued ones are answered the same once the
        pool has stayed empty for ``grace`` (a health-check cycle: an endpoint that failed its
        checks in a blip passes the next one within it, and serves them in their order). A
        longer outage is not waited out to the TTL, whose 429 would read as load. Returns how
        many were answered."""
        queue = self.queues.get(model)
        if queue is None:
            return 0
        if queue.empty_since is None:
            queue.empty_since = now
        empty_for = now - queue.empty_since
        if empty_for < grace:
            return 0
        message = (
            f"no healthy endpoint serves model {model!r} "
            f"(none for {empty_for:.1f}s while the request was queued)"
        )
        items = [
            item
            for level in queue.levels.values()
            for flow in level.flows.values()
            for item in flow.items.values()
        ]
        for item in items:
            self.unlink(item, rotate=False)
            self._metrics.rejections.labels("no-endpoints").inc()
            if not item.future.done():
                item.future.set_exception(NoEndpointsError(message))
        return len(items)

    def close(self) -> None:
        """Refuse everything still queued (the gateway is shutting down)."""
        for _, _, item in self._deadlines:
            if item.queued:
                self.unlink(item, rotate=False)
                self.fail(item, "shutdown")
        self._deadlines.clear()

    def flows(self) -> Iterator[FlowQueue]:
        for queue in self.queues.values():
            for level in queue.levels.values():
                yield from level.flows.values()
