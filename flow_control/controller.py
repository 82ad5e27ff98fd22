"""The flow controller: admit, queue, dispatch and shed requests before scheduling.

A request passes at once (fast path: no task switch, nothing allocated but its ticket) when the
pool for its model is not saturated and nothing of equal or higher priority is queued for that
model (such work of another model, which may share its endpoints, is dispatched first).
Otherwise it waits in its flow's queue until the controller dispatches it: strict priority
across levels, the band's fairness policy across the flows of a level, FCFS within a flow.
Dispatching happens once per event that frees a place (a lease's first byte or release, the
release of a ticket that never took an endpoint, a scrape), and on a short tick while anything
is queued, since engine metrics move between those. Full queues push out the newest request of
the longest flow (lowest priority first) rather than refuse a lighter tenant's newcomer. A
queue whose pool stays empty for a health-check cycle is answered as admission would be.

Everything runs on the event loop and nothing blocks: no locks are needed.
"""

from __future__ import annotations

import asyncio
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
from flow_control.queues import BandState
from flow_control.request import FlowRequest, Ticket
from flow_control.resolve import RequestResolver
from flow_control.saturation import (
    DEFAULT_SCRAPE_INTERVAL,
    DEFAULT_SCRAPE_TIMEOUT,
    SaturationDetector,
    ThresholdSaturationDetector,
    default_staleness,
)
from flow_control.tickets import IssuedTickets
from flow_control.waiting import WaitingRoom
from router.core.endpoints import EndpointSnapshot
from router.core.errors import NoEndpointsError, SaturatedError, SLORejectedError
from router.core.tasks import cancel_and_wait

log = logging.getLogger("prefixgate.flow_control")

Candidates = Callable[[str], list[EndpointSnapshot]]

# pool.healthCheck's defaults, intervalSeconds + timeoutSeconds (a test keeps them equal; the app
# passes the configured ones): the time an endpoint that failed its checks takes to pass one.
DEFAULT_HEALTH_CYCLE = 3.0


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
        health_cycle: float = DEFAULT_HEALTH_CYCLE,
    ) -> None:
        # scrape_*: pool.metricsScrape, from which the detector derives its staleness bound.
        # health_cycle: pool.healthCheck interval + timeout, how long a queue waits for its
        # empty pool to come back (WaitingRoom.pool_empty).
        self.config = config
        self.enabled = config.enabled
        self._candidates = candidates
        self._clock = clock
        self._health_cycle = health_cycle
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
        self._room = WaitingRoom(config, self._metrics, self._resolver.objectives.ttl)
        # Tickets not yet released, and those whose request has taken no endpoint yet.
        self._tickets = IssuedTickets()
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
        if not saturated:
            saturated = self._yield_to_other_models(model, request.priority, snapshots)
        band = self._band_for(request.priority)
        ahead = self._room.max_priority(model)
        if not saturated and (ahead is None or ahead < request.priority):
            return self._issue(request, band, 0.0, "fast", snapshots)
        if saturated and request.priority < 0:
            raise self._shed("sheddable", f"pool for model {model!r} is saturated")
        if self._stopped:
            raise self._shed("shutdown", "the gateway is shutting down")
        item = self._room.enqueue(request, band, self._clock())
        if self._wakeup is not None:
            self._wakeup.set()
        if not saturated:
            self._dispatch([model])  # work of equal priority is ahead: policy order decides
            if item.queued and request.priority < 0:
                # The work ahead took the room: the pool is saturated now, so shed it as at
                # the door rather than let it wait out its TTL.
                self._room.unlink(item, rotate=False)
                item.future.cancel()
                raise self._shed("sheddable", f"pool for model {model!r} is saturated")
        return await self._room.wait(item)

    def _yield_to_other_models(
        self, model: str, priority: int, snapshots: list[EndpointSnapshot]
    ) -> bool:
        """Room appeared with nothing dispatched into it yet (between two ticks): other
        models' work queued at ``priority`` or above may be waiting for it, since models share
        endpoints (a base model and its adapters). It goes first, as the same model's would;
        returns whether ``model``'s pool is saturated after it."""
        queues = self._room.queues
        if not queues:
            return False
        others = [m for m, q in queues.items() if m != model and max(q.levels) >= priority]
        if not others or not self._dispatch(others, floor=priority):
            return False
        return self._saturated(model, snapshots)

    def _band_for(self, priority: int) -> BandState:
        """The nearest band at or below ``priority``; the default band below them all."""
        i = bisect_right(self._band_priorities, priority)
        return self._bands[i - 1] if i else self._default_band

    def _saturated(self, model: str, snapshots: list[EndpointSnapshot]) -> bool:
        # Counted, not inferred from in_flight (see flow_control/tickets.py).
        pending = self._tickets.pending(model, snapshots)
        saturated = self._detector.saturated(snapshots, pending)
        self._metrics.set_saturated(model, saturated)
        return saturated

    def _shed(self, reason: str, message: str) -> SaturatedError:
        self._metrics.rejections.labels(reason).inc()
        return SaturatedError(message, retry_after=self.config.retry_after_seconds)

    def _issue(
        self,
        request: FlowRequest,
        band: BandState,
        waited: float,
        path: Literal["fast", "queued"],
        snapshots: list[EndpointSnapshot],
    ) -> Ticket:
        self._tickets.issue(request.model, snapshots)
        self._resolver.boost.served(request.session_id)
        band.wait.observe(waited)
        (band.fast if path == "fast" else band.queued).inc()
        return Ticket(request, waited, self._on_release, self._on_leased)

    def _on_leased(self, ticket: Ticket) -> None:
        self._tickets.placed(ticket.request.model)

    def _on_release(self, ticket: Ticket) -> None:
        request = ticket.request
        leased = ticket.was_leased
        self._tickets.released(request.model, leased)
        # A turn that just ended is what makes its session live for the next one.
        self._resolver.boost.served(request.session_id)
        queues = self._room.queues
        # A ticket that took an endpoint holds no place of its own: its lease held it, and
        # the lease's release dispatches (Router.lease), before or after this one. Dispatching
        # here too would run the same pass twice for one request that ends.
        if queues and not leased:
            # Models share endpoints (a base model and its adapters), so the room freed may be
            # another model's too: every model's queue, in turn (see _dispatch).
            try:
                self._dispatch(list(queues))
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
        if not self._room.count or not self.enabled:
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

    # -- dispatching ------------------------------------------------------------------------

    def dispatch(self) -> int:
        """Expire what is past its TTL, then dispatch every model's queue while its pool is
        not saturated. Returns the number dispatched (the tick calls this; so can tests)."""
        self.expire()
        return self._dispatch(list(self._room.queues))

    def _dispatch(self, models: list[str], floor: int | None = None) -> int:
        """Dispatch the queues of ``models`` while their pools have room, one request at a
        time: the highest priority queued among them first, and models of equal priority in
        turn (round-robin, as the flows of a level). Models share endpoints (a base model and
        its adapters), so a place freed there goes to the most urgent request waiting for it,
        whichever its model, and no model's queue waits for another's to empty. ``floor``:
        only work queued at that priority or above."""
        queues = self._room.queues
        open_models = [model for model in models if model in queues]
        dispatched = 0
        while open_models:
            model = max(open_models, key=lambda m: max(queues[m].levels))
            if floor is not None and max(queues[model].levels) < floor:
                break
            outcome = self._dispatch_one(model)
            dispatched += outcome or 0
            if outcome is None or model not in queues:
                open_models.remove(model)
            elif outcome:
                open_models.remove(model)  # its turn has passed: last among its equals,
                open_models.append(model)
                queues[model] = queues.pop(model)  # in later rounds too
        return dispatched

    def _dispatch_one(self, model: str) -> int | None:
        """Dispatch the head of ``model``'s queue: 1, or 0 when that head had been cancelled
        or had expired; None when the pool has no room (dispatching more takes none back)."""
        queue = self._room.queues[model]
        snapshots = self._candidates(model)
        if not snapshots:
            self._room.pool_empty(model, self._clock(), self._health_cycle)
            return None
        queue.empty_since = None
        if self._saturated(model, snapshots):
            return None
        level = queue.top()
        item = level.band.policy.select(level.flows).head()
        now = self._clock()
        # A head cancelled (its task has not run yet) or expired leaves unserved: its flow
        # is not charged, nor does its turn pass.
        cancelled, expired = item.future.done(), item.deadline <= now
        self._room.unlink(item, rotate=not (cancelled or expired))
        if cancelled:
            self._metrics.rejections.labels("cancelled").inc()
            return 0
        if expired:
            self._room.fail(item, "ttl-expired")
            return 0
        waited = max(0.0, now - item.enqueued_at)
        item.future.set_result(
            self._issue(item.request, level.band, waited, "queued", snapshots)
        )
        return 1

    def expire(self) -> int:
        """Reject queued requests whose TTL has passed; returns how many."""
        return self._room.expire(self._clock())

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the dispatch tick; call from the running loop (the app's lifespan)."""
        self._stopped = False
        if self._task is not None or not self.enabled:
            return
        self._wakeup = asyncio.Event()
        if self._room.count:
            self._wakeup.set()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-control")

    async def stop(self) -> None:
        """Stop the tick and reject everything still queued (429, as a shed request)."""
        self._stopped = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self._room.close()

    async def _run(self) -> None:
        assert self._wakeup is not None
        interval = self.config.dispatch_interval_seconds
        while True:
            if not self._room.count:
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
        return self._room.count

    @property
    def queued_bytes(self) -> int:
        return self._room.bytes

    def active_flows(self) -> int:
        """Flows with queued requests (empty flows are dropped at once)."""
        return sum(1 for _ in self._room.flows())

    def outstanding(self, model: str) -> int:
        """Tickets issued for ``model`` and not yet released."""
        return self._tickets.outstanding(model)
