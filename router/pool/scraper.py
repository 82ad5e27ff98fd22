"""Background health checks and vLLM metric scraping, one task per endpoint.

It polls with the gateway's own HTTP/1.1 client (router/upstream), a separate instance from the
proxy's so that health checks never queue behind traffic: the cheapest client per scrape on the
event loop that relays every stream (docs/benchmarks/http-client.md); eight endpoints are
scraped eighty times a second.

The pages themselves are parsed in router/pool/engine_pages.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from router.core.endpoints import EndpointState, RemoteLoad
from router.core.pool import EndpointPool
from router.core.tasks import cancel_all
from router.pool.engine_pages import listed_models, parse_vllm_metrics
from router.upstream.client import UPSTREAM_ERRORS, ResponseTooLargeError, UpstreamClient

log = logging.getLogger("prefixgate.scraper")

# A metrics page or model list bigger than this is not read (a failed poll).
MAX_PAGE_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    scrape_interval: float = 0.1
    scrape_timeout: float = 0.5
    health_interval: float = 2.0
    health_timeout: float = 1.0
    unhealthy_threshold: int = 3


CapacityCallback = Callable[[str, int, int], None]
# The headers an endpoint's own API key needs (vLLM guards /v1/* with --api-key), by endpoint id.
AuthHeaders = Callable[[str], Mapping[str, str]]


class EndpointMonitor:
    """Owns one polling task per endpoint; started and stopped by the app's lifespan. The
    client is the composition root's, which closes it."""

    def __init__(
        self,
        pool: EndpointPool,
        client: UpstreamClient,
        settings: MonitorSettings,
        on_capacity: CapacityCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth_headers: AuthHeaders | None = None,
        remote_load: Callable[[str], RemoteLoad] | None = None,
        on_scrape: Callable[[], None] | None = None,
        on_restart: Callable[[str, float], Awaitable[None]] | None = None,
        on_base_model: Callable[[str, str | None], None] | None = None,
        on_healthy: Callable[[EndpointState], None] | None = None,
    ) -> None:
        self._pool = pool
        # Told when an endpoint passes its health check after failing (or first): the speed
        # probe times it then.
        self._on_healthy = on_healthy
        # Told the one base model an endpoint lists (None: not one) when its list changes:
        # its adapters run on it, and the index sizer sizes the endpoint by it.
        self._on_base_model = on_base_model
        # Told when an endpoint's engine restarted, with the new engine's start time (0:
        # unknown): its prefix cache is empty, whatever the index remembers of it.
        self._on_restart = on_restart
        self._queries: dict[str, float] = {}  # endpoint -> its last prefix-cache query count
        self._lives: dict[str, float] = {}  # endpoint -> its engine's last known start time
        # Called after each scrape or health change: flow control re-reads the pool at once
        # instead of waiting for its next tick.
        self._on_scrape = on_scrape
        self._auth_headers = auth_headers
        # The other gateway replicas' load (shared through Redis), so that their requests
        # counted in a stale scrape do not pass for a stranger's queue either.
        self._remote_load = remote_load
        self._client = client
        self._settings = settings
        self._on_capacity = on_capacity
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        for state in self._pool:
            self.watch(state)

    def watch(self, state: EndpointState) -> None:
        if state.endpoint.id not in self._tasks:
            task = asyncio.create_task(self._run(state), name=f"monitor:{state.endpoint.id}")
            self._tasks[state.endpoint.id] = task

    def unwatch(self, endpoint_id: str, forget: bool = True) -> None:
        """Stop polling an endpoint that left the pool (Kubernetes discovery); ``forget``:
        for good, else (not ready) its last query count stays, so that a restart while it
        was out (a container restart turns its pod NotReady) is still told."""
        task = self._tasks.pop(endpoint_id, None)
        if forget:
            self._queries.pop(endpoint_id, None)
            self._lives.pop(endpoint_id, None)
        if task is not None:
            task.cancel()

    async def check_all(self) -> None:
        """One health round for every endpoint now (start-up, so /ready is true at once)."""
        await asyncio.gather(*(self._health(s) for s in self._pool))

    async def stop(self) -> None:
        await cancel_all(self._tasks)

    async def _run(self, state: EndpointState) -> None:
        next_health = self._clock() + self._settings.health_interval
        failing = False
        health_ok = True  # the last health check's answer
        while True:
            try:
                if self._clock() >= next_health:
                    next_health = self._clock() + self._settings.health_interval
                    health_ok = await self._health(state)
                if self._pool.ejection_expired(state):
                    await self._probe_ejected(state)
                if state.healthy:
                    await self._scrape(state, health_ok)
                if self._on_scrape is not None:
                    self._on_scrape()
                failing = False
            except Exception:
                # An endpoint whose monitor died would stay as healthy as it last was, for good.
                if not failing:
                    log.exception("endpoint %s: monitoring step failed", state.endpoint.id)
                failing = True
            await asyncio.sleep(self._settings.scrape_interval)

    async def _get(
        self, url: str, seconds: float, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        fields = list(headers.items()) if headers else []
        got = await self._client.fetch("GET", url, fields, seconds=seconds, limit=MAX_PAGE_BYTES)
        return got.status, got.body

    async def _probe(self, state: EndpointState) -> bool:
        try:
            url = f"{state.endpoint.url}/health"
            status, _ = await self._get(url, self._settings.health_timeout)
        except UPSTREAM_ERRORS:
            return False
        return status == 200

    async def _health(self, state: EndpointState) -> bool:
        ok = await self._probe(state)
        if ok:
            await self._read_models(state)  # before it is marked healthy: routable at once
        self._mark(state, ok)
        return ok

    async def _probe_ejected(self, state: EndpointState) -> None:
        """An ejected endpoint's time is up: back in only if it answers its health check."""
        if await self._probe(state):
            self._pool.readmit(state)
        else:
            self._pool.extend_ejection(state)

    async def _read_models(self, state: EndpointState) -> None:
        """What the replica serves now, read with every health check: vLLM loads and unloads
        LoRA adapters at runtime (``/v1/load_lora_adapter``), each listed in ``/v1/models``
        next to its base model. A listing that fails or names nothing changes nothing, and
        fails no health check: ``/health`` alone decides that. An endpoint configured with its
        models serves those (the config says so), whatever it lists."""
        if state.endpoint.models:
            return
        headers = self._auth_headers(state.endpoint.id) if self._auth_headers else None
        try:
            status, body = await self._get(
                f"{state.endpoint.url}/v1/models", self._settings.health_timeout, headers
            )
        except UPSTREAM_ERRORS:
            log.debug("endpoint %s: /v1/models did not answer", state.endpoint.id)
            return
        if status != 200:
            return  # what it served before, it still does
        listed = listed_models(body)
        if listed is None:
            level = logging.DEBUG if state.models else logging.WARNING
            log.log(level, "endpoint %s: unreadable /v1/models", state.endpoint.id)
            return
        served = set(listed)
        if not served or served == state.models:
            return
        if state.models:
            log.info(
                "endpoint %s: models now %s (added %s, removed %s)", state.endpoint.id,
                sorted(served), sorted(served - state.models), sorted(state.models - served),
            )
        state.models.clear()
        state.models.update(served)
        if self._on_base_model is not None:
            bases = [model for model, parent in listed.items() if parent is None]
            self._on_base_model(state.endpoint.id, bases[0] if len(bases) == 1 else None)

    async def _scrape(self, state: EndpointState, health_ok: bool = True) -> None:
        """Read the endpoint's metrics; ``health_ok``: its last health check passed."""
        url = state.endpoint.url
        in_flight, decoding = self._counts(state)
        kv_tokens = state.in_flight_kv_tokens
        try:
            status, body = await self._get(f"{url}/metrics", self._settings.scrape_timeout)
        except TimeoutError:
            # A replica busy enough to answer /metrics late is not a dead one: its metrics go
            # stale, and its health checks decide (a timeout counted here took a serving
            # replica out after three scrape intervals).
            return
        except ResponseTooLargeError:
            # Answered, at more than MAX_PAGE_BYTES: stale metrics too, not a dead replica
            # (the error is a ConnectionError, which the next clause would count as one).
            log.debug("endpoint %s: /metrics over %d bytes", state.endpoint.id, MAX_PAGE_BYTES)
            return
        except UPSTREAM_ERRORS:
            self._mark(state, False)  # refused or reset: gone, noticed well before a health check
            return
        if status != 200:
            return  # not every backend exports metrics; health decides liveness
        previous = state.metrics
        now = self._clock()
        m = state.metrics = parse_vllm_metrics(body.decode("utf-8", "replace"), now)
        # Gateway requests the scrape may have counted: the most in flight before or after
        # it; and those surely past their first byte while it ran: the fewest.
        in_flight_after, decoding_after = self._counts(state)
        m.gateway_in_flight = max(in_flight, in_flight_after)
        m.gateway_kv_tokens = max(kv_tokens, state.in_flight_kv_tokens)
        # On the pool's clock, which snapshots read the limit's age with.
        state.slots.observe_scrape(
            m.running, m.waiting, m.kv_usage, min(decoding, decoding_after),
            self._pool.clock(), max_gap_s=2.5 * self._settings.scrape_interval,
        )
        if health_ok:
            # Clears the failed scrapes only: a page served while /health fails (vLLM's API
            # server whose engine died answers 503 there, 200 here) passes no health check.
            state.consecutive_failures = 0
        capacity_changed = (m.block_size, m.num_gpu_blocks) != (
            previous.block_size,
            previous.num_gpu_blocks,
        )
        if capacity_changed and m.block_size and m.num_gpu_blocks and self._on_capacity:
            self._on_capacity(state.endpoint.id, m.block_size, m.num_gpu_blocks)
        await self._check_restart(state.endpoint.id, m.prefix_queries, m.engine_started)

    async def _check_restart(self, endpoint_id: str, queries: float, started: float) -> None:
        """A new engine process at the same address (a container restarted in its pod) serves
        with an empty prefix cache. Told by its start time changing between known values (0,
        unknown, is compared with nothing), which a gateway that last saw the old engine below
        the new one's count sees too; else by the counter going back (a count of 0, no query
        yet, is compared with nothing: the next one counting, below the last, tells it)."""
        last_life = self._lives.get(endpoint_id, 0.0)
        new_life = last_life > 0 and started > 0 and started != last_life
        if started > 0:
            self._lives[endpoint_id] = started
        went_back = 0 < queries < self._queries.get(endpoint_id, 0.0)
        if queries > 0 or new_life:  # a new engine's 0 too: its first count is no 2nd restart
            self._queries[endpoint_id] = queries
        if (new_life or went_back) and self._on_restart is not None:
            why = "start time changed" if new_life else "prefix-cache query count went back"
            log.warning("endpoint %s restarted (its %s): its prefixes forgotten", endpoint_id, why)
            await self._on_restart(endpoint_id, started)

    def _counts(self, state: EndpointState) -> tuple[int, int]:
        """The gateways' requests in flight to the endpoint, and those past their first
        byte (this replica's, plus the others' shared through Redis, up to a sync old)."""
        in_flight = state.in_flight
        decoding = in_flight - state.pending_prefill_requests - state.headers_only
        if self._remote_load is not None:
            remote, _, remote_pending, _ = self._remote_load(state.endpoint.id)
            in_flight += remote
            decoding += remote - remote_pending
        return in_flight, decoding

    def _mark(self, state: EndpointState, ok: bool) -> None:
        if ok:
            came_up = not state.healthy
            state.healthy = True
            state.consecutive_failures = 0
            if came_up:
                log.info("endpoint %s is healthy", state.endpoint.id)
                if self._on_healthy is not None:
                    self._on_healthy(state)
            return
        state.consecutive_failures += 1
        if state.healthy and state.consecutive_failures >= self._settings.unhealthy_threshold:
            log.warning("endpoint %s is unhealthy", state.endpoint.id)
            state.healthy = False
