"""The flow controller: admit, queue, dispatch and shed requests before scheduling.

A request passes at once (fast path: no task switch, nothing allocated but its ticket) when the
pool for its model is not saturated and nothing of equal or higher priority is queued for that
model. Otherwise it waits in its flow's queue until the controller dispatches it: strict
priority across levels, the band's fairness policy across the flows of a level, FCFS within a
flow. Dispatching happens whenever a ticket is released and on a short tick while anything is
queued, since engine metrics move between releases. Full queues push out the newest request of
the longest flow (lowest priority first) rather than refuse a lighter tenant's newcomer.

Everything runs on the event loop and nothing blocks: no locks are needed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from bisect import bisect_right
from collections.abc import Callable
from typing import Literal

from prometheus_client import CollectorRegistry

from flow_control.config import BandConfig, FlowControlConfig
from flow_control.limits import ConcurrencyLimits, ConcurrencySaturationDetector
from flow_control.metrics import FlowControlMetrics
from flow_control.policies import make_policy
from flow_control.queues import BandState, FlowQueue, Level, ModelQueue, QueueItem, pick_victim
from flow_control.request import FlowRequest, Ticket
from flow_control.resolve import RequestResolver
from flow_control.saturation import (
    DEFAULT_SCRAPE_INTERVAL,
    DEFAULT_SCRAPE_TIMEOUT,
    SaturationDetector,
    ThresholdSaturationDetector,
    default_staleness,
)
from router.core.endpoints import EndpointSnapshot
from router.core.errors import NoEndpointsError, SaturatedError, SLORejectedError, TTLExpiredError
from router.core.tasks import cancel_and_wait

log = logging.getLogger("prefixgate.flow_control")

Candidates = Callable[[str], list[EndpointSnapshot]]
_FAILURES = {
    "evicted": "flow control queues are full and this tenant holds the most queued requests",
    "shutdown": "the gateway is shutting down",
}


class FlowController:
    def __init__(
        self,
        config: FlowControlConfig,
        candidates: Candidates,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        detector: SaturationDetector | None = None,
        max_flow_labels: int = 100,
        scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
        scrape_timeout: float = DEFAULT_SCRAPE_TIMEOUT,
    ) -> None:
        # scrape_*: pool.metricsScrape, from which the detector derives its staleness bound.
        self.config = config
        self.enabled = config.enabled
        self._candidates = candidates
        self._clock = clock
        self.limits: ConcurrencyLimits | None = None
        if detector is None:
            detector = self._default_detector(config, scrape_interval, scrape_timeout)
        self._detector = detector
        self._metrics = FlowControlMetrics(registry or CollectorRegistry(), max_flow_labels)
        if self.limits is not None:
            self._metrics.watch_limits(self.limits)
        self._resolver = RequestResolver(config, clock)
        # Resolve fairness id, objective (priority, TTL) and session boost from headers.
        self.build_request = self._resolver.build
        bands = sorted(config.priority_bands, key=lambda b: b.priority)
        self._band_priorities = [b.priority for b in bands]
        self._bands = [self._band(str(b.priority), b.priority, b) for b in bands]
        self._default_band = self._band("default", None, config.default_band)
        self._queues: dict[str, ModelQueue] = {}
        self._issued: dict[str, int] = {}  # tickets not yet released, per model
        # Of those, the ones whose request has not taken an endpoint yet (Ticket.leased): no
        # endpoint's in-flight count shows them.
        self._unplaced: dict[str, int] = {}
        self._deadlines: list[tuple[float, int, QueueItem]] = []
        self._seq = itertools.count()
        self._count = 0
        self._bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopped = False

    def _default_detector(
        self, config: FlowControlConfig, scrape_interval: float, scrape_timeout: float
    ) -> SaturationDetector:
        cfg = config.saturation_detector
        staleness = cfg.metrics_staleness_threshold
        if staleness is None:
            staleness = default_staleness(scrape_interval, scrape_timeout)
        if cfg.type == "utilization":
            return ThresholdSaturationDetector(
                cfg, scrape_interval=scrape_interval, scrape_timeout=scrape_timeout
            )
        self.limits = ConcurrencyLimits(cfg.concurrency_limit)
        return ConcurrencySaturationDetector(self.limits, staleness)

    def _band(self, name: str, priority: int | None, limits: BandConfig) -> BandState:
        m = self._metrics
        return BandState(
            name=name,
            priority=priority,
            limits=limits,
            policy=make_policy(limits.fairness_policy, limits.program_aware, self._clock),
            gauge_requests=m.queue_requests.labels(name),
            gauge_bytes=m.queue_bytes.labels(name),
            wait=m.queue_wait.labels(name),
            fast=m.dispatches.labels(name, "fast"),
            queued=m.dispatches.labels(name, "queued"),
        )

    # -- admission --------------------------------------------------------------------------

    async def admit(self, request: FlowRequest) -> Ticket:
        """Wait until the request may go upstream; release the returned ticket when done.

        Raises NoEndpointsError (no endpoint at all), SaturatedError (queue limits, or a
        sheddable request while saturated) and TTLExpiredError (waited past its TTL). When the
        waiting task is cancelled the request just leaves its queue.
        """
        if not self.enabled:
            return Ticket(request)
        model = request.model
        snapshots = self._candidates(model)
        if not snapshots:
            self._metrics.rejections.labels("no-endpoints").inc()
            raise NoEndpointsError(f"no healthy endpoint serves model {model!r}")
        saturated = self._saturated(model, snapshots)
        band = self._band_for(request.priority)
        queue = self._queues.get(model)
        ahead = queue.max_priority() if queue is not None else None
        if not saturated and (ahead is None or ahead < request.priority):
            return self._issue(request, band, 0.0, "fast")
        if saturated and request.priority < 0:
            raise self._shed("sheddable", f"pool for model {model!r} is saturated")
        if self._stopped:
            raise self._shed("shutdown", "the gateway is shutting down")
        item = self._enqueue(request, band)
        if not saturated:
            self._dispatch_model(model)  # work of equal priority is ahead: policy order decides
        return await self._wait(item)

    def _band_for(self, priority: int) -> BandState:
        """The nearest band at or below ``priority``; the default band below them all."""
        i = bisect_right(self._band_priorities, priority)
        return self._bands[i - 1] if i else self._default_band

    def _saturated(self, model: str, snapshots: list[EndpointSnapshot]) -> bool:
        # Counted, not inferred from in_flight: that one also holds other gateways' requests,
        # and not those of endpoints that have left the candidates while their streams go on.
        pending = self._unplaced.get(model, 0)
        saturated = self._detector.saturated(snapshots, pending)
        self._metrics.set_saturated(model, saturated)
        return saturated

    def _shed(self, reason: str, message: str) -> SaturatedError:
        self._metrics.rejections.labels(reason).inc()
        return SaturatedError(message, retry_after=self.config.retry_after_seconds)

    def _issue(
        self, request: FlowRequest, band: BandState, waited: float, path: Literal["fast", "queued"]
    ) -> Ticket:
        model = request.model
        self._issued[model] = self._issued.get(model, 0) + 1
        self._unplaced[model] = self._unplaced.get(model, 0) + 1
        self._resolver.boost.served(request.session_id)
        band.wait.observe(waited)
        (band.fast if path == "fast" else band.queued).inc()
        return Ticket(request, waited, self._on_release, self._on_leased)

    def _on_leased(self, ticket: Ticket) -> None:
        _decrement(self._unplaced, ticket.request.model)

    def _on_release(self, ticket: Ticket) -> None:
        request = ticket.request
        _decrement(self._issued, request.model)
        if not ticket.was_leased:
            _decrement(self._unplaced, request.model)
        # A turn that just ended is what makes its session live for the next one.
        self._resolver.boost.served(request.session_id)
        if request.model in self._queues:
            try:
                self._dispatch_model(request.model)
            except Exception:  # a release must never fail the request that ends; tick retries
                log.exception("flow control dispatch on release failed")

    def observe(self, endpoint_id: str, ratio: float, queued_at_send: int) -> None:
        """A first byte from ``endpoint_id`` (see ConcurrencyLimits.observe); it also frees a
        place in the endpoint's prefill queue, so queued work is dispatched at once."""
        if self.limits is not None:
            self.limits.observe(endpoint_id, ratio, queued_at_send)
        self.poke()

    def poke(self) -> None:
        """Something the detector reads changed (a first byte, a scrape): dispatch now rather
        than on the next tick. Never raises: callers are on the request and scrape paths."""
        if not self._count or not self.enabled:
            return
        try:
            self.dispatch()
        except Exception:
            log.exception("flow control dispatch failed")

    def ttft_slo_ms(self, objective: str | None) -> float | None:
        """The objective's configured time-to-first-token target, if any."""
        return self._resolver.objectives.ttft_slo_ms(objective)

    def reject_slo(self, message: str) -> SLORejectedError:
        self._metrics.rejections.labels("slo").inc()
        return SLORejectedError(message, retry_after=self.config.retry_after_seconds)

    async def forget_endpoint(self, endpoint_id: str) -> None:
        if self.limits is not None:
            self.limits.forget(endpoint_id)

    # -- queues -----------------------------------------------------------------------------

    def _enqueue(self, request: FlowRequest, band: BandState) -> QueueItem:
        size = max(0, request.size)
        self._make_room(request, band, size)
        now = self._clock()
        arrival = request.arrival if request.arrival is not None else now
        deadline = arrival + self._resolver.objectives.ttl(request.objective)
        queue = self._queues.get(request.model)
        if queue is None:
            queue = self._queues[request.model] = ModelQueue()
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
        if len(self._deadlines) > 2 * self._count + 64:
            # Dispatched and cancelled items stay in the heap until popped: compact it so
            # that it stays bounded by what is queued.
            self._deadlines = [e for e in self._deadlines if e[2].queued]
            heapq.heapify(self._deadlines)
        if self._wakeup is not None:
            self._wakeup.set()
        return item

    def _make_room(self, request: FlowRequest, band: BandState, size: int) -> None:
        """Push out queued requests (see ``pick_victim``) until ``request`` fits, or shed it."""
        cfg = self.config
        while True:
            band_full = not band.fits(size)
            global_full = self._count >= cfg.max_requests or self._bytes + size > cfg.max_bytes
            if not band_full and not global_full:
                return
            too_big = size > band.limits.max_bytes or size > cfg.max_bytes
            victim = None if too_big else pick_victim(
                self._queues.values(), request, band if band_full else None
            )
            if victim is None:
                full = f"queue of band {band.name!r} is" if band_full else "queues are"
                raise self._shed("queue-full", f"flow control {full} full")
            self._unlink(victim, rotate=False)
            self._fail(victim, "evicted")

    def _account(self, item: QueueItem, size: int, sign: int) -> None:
        flow, band = item.flow, item.level.band
        flow.bytes += sign * size
        band.count += sign
        band.bytes += sign * size
        self._count += sign
        self._bytes += sign * size
        flow.gauge_requests.inc(sign)
        flow.gauge_bytes.inc(sign * size)
        band.gauge_requests.inc(sign)
        band.gauge_bytes.inc(sign * size)

    def _unlink(self, item: QueueItem, rotate: bool) -> None:
        """Take a queued item out, dropping every structure that empties."""
        item.queued = False
        flow, level = item.flow, item.level
        del flow.items[item.seq]
        self._account(item, max(0, item.request.size), -1)
        queue = self._queues[item.request.model]
        queue.count -= 1
        if not flow.items:
            del level.flows[flow.fairness_id]
        elif rotate:
            level.band.policy.dispatched(level.flows, flow)
        if not level.flows:
            del queue.levels[level.priority]
        if not queue.levels:
            del self._queues[item.request.model]

    async def _wait(self, item: QueueItem) -> Ticket:
        try:
            return await item.future
        except asyncio.CancelledError:
            if item.queued:
                self._unlink(item, rotate=False)
                self._metrics.rejections.labels("cancelled").inc()
            elif (
                item.future.done()
                and not item.future.cancelled()
                and item.future.exception() is None
            ):
                # Dispatched just before the cancel arrived: give the slot back.
                item.future.result().release()
            raise

    # -- dispatching ------------------------------------------------------------------------

    def dispatch(self) -> int:
        """Expire what is past its TTL, then dispatch every model's queue while its pool is
        not saturated. Returns the number dispatched (the tick calls this; so can tests)."""
        self.expire()
        return sum(self._dispatch_model(model) for model in list(self._queues))

    def _dispatch_model(self, model: str) -> int:
        dispatched = 0
        queue = self._queues.get(model)
        while queue is not None:
            snapshots = self._candidates(model)
            # An empty pool keeps its queue: endpoints may come back before the TTL ends.
            if not snapshots or self._saturated(model, snapshots):
                break
            level = queue.top()
            item = level.band.policy.select(level.flows).head()
            self._unlink(item, rotate=True)
            queue = self._queues.get(model)
            if item.future.done():  # its task was cancelled and has not run yet
                self._metrics.rejections.labels("cancelled").inc()
                continue
            now = self._clock()
            if item.deadline <= now:
                self._fail(item, "ttl-expired")
                continue
            waited = max(0.0, now - item.enqueued_at)
            item.future.set_result(self._issue(item.request, level.band, waited, "queued"))
            dispatched += 1
        return dispatched

    def expire(self) -> int:
        """Reject queued requests whose TTL has passed; returns how many."""
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            item = heapq.heappop(self._deadlines)[2]
            if item.queued:
                self._unlink(item, rotate=False)
                self._fail(item, "ttl-expired")
                expired += 1
        return expired

    def _fail(
        self, item: QueueItem, reason: Literal["ttl-expired", "evicted", "shutdown"]
    ) -> None:
        self._metrics.rejections.labels(reason).inc()
        if item.future.done():
            return
        retry = self.config.retry_after_seconds
        if reason == "ttl-expired":
            ttl = self._resolver.objectives.ttl(item.request.objective)
            message = f"request waited longer than its TTL of {ttl:g}s in the flow control queue"
            item.future.set_exception(TTLExpiredError(message, retry_after=retry))
        else:
            item.future.set_exception(SaturatedError(_FAILURES[reason], retry_after=retry))

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the dispatch tick; call from the running loop (the app's lifespan)."""
        self._stopped = False
        if self._task is not None or not self.enabled:
            return
        self._wakeup = asyncio.Event()
        if self._count:
            self._wakeup.set()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-control")

    async def stop(self) -> None:
        """Stop the tick and reject everything still queued (429, as a shed request)."""
        self._stopped = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for _, _, item in self._deadlines:
            if item.queued:
                self._unlink(item, rotate=False)
                self._fail(item, "shutdown")
        self._deadlines.clear()

    async def _run(self) -> None:
        assert self._wakeup is not None
        interval = self.config.dispatch_interval_seconds
        while True:
            if not self._count:
                self._wakeup.clear()
                await self._wakeup.wait()
            await asyncio.sleep(interval)
            try:
                self.dispatch()
            except Exception:  # the tick must survive a faulty candidates() or detector
                log.exception("flow control dispatch failed")

    # -- introspection ----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._count

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def active_flows(self) -> int:
        """Flows with queued requests (empty flows are dropped at once)."""
        return sum(
            len(level.flows) for queue in self._queues.values() for level in queue.levels.values()
        )

    def outstanding(self, model: str) -> int:
        """Tickets issued for ``model`` and not yet released."""
        return self._issued.get(model, 0)


def _decrement(counts: dict[str, int], model: str) -> None:
    left = counts.get(model, 0) - 1
    if left > 0:
        counts[model] = left
    else:
        counts.pop(model, None)
