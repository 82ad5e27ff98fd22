"""The composition root: builds the gateway's whole object graph from the config, every object
complete with its collaborators (constructor injection, no module-level state), and the
lifespan that only starts and stops what the graph owns, in order.

Objects that need a running event loop (tasks, connections) are built without one and opened
in ``start()``; :func:`gateway_running` starts them and an ``AsyncExitStack`` stops them in
reverse order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from flow_control.controller import FlowController
from router import __version__
from router.api.asgi import GatewayApp
from router.api.count_tokens import TokenCounting
from router.api.logs import LogDrops
from router.api.loop_lag import LoopLagMonitor
from router.api.prediction import ANSWERS_READ_BURST, ANSWERS_READ_PER_S, PredictionTracker
from router.api.proxy import Proxy
from router.api.request_body import BodyParser, BodyPreparer
from router.api.routes import add_routes
from router.api.stored_responses import StoredResponses, make_probe
from router.app.routing import RoutingGraph, build_disagg, build_routing
from router.config.model import GatewayConfig
from router.core.endpoints import Endpoint
from router.core.framework import Scheduler
from router.core.pool import EndpointPool, OutlierSettings
from router.core.sampling import RateSampler
from router.estimators.calibration import Calibrator
from router.estimators.token_density import TokenDensity
from router.index.sizing import IndexSizer
from router.index.stores import Stores, build_stores
from router.index.token_counts import TokenCounts
from router.pool.discovery import Forget, KubernetesDiscovery, LivePool
from router.pool.metrics import GatewayMetrics
from router.pool.scraper import CapacityCallback, EndpointMonitor, MonitorSettings
from router.pool.speed_probe import SpeedProbe
from router.precise.runtime import PreciseRuntime
from router.protocol.auth import UpstreamKeys, build_authenticator, build_upstream_keys
from router.scheduling.plugins import PluginRegistry, default_registry, endpoint_forgetters
from router.scheduling.routing import Router
from router.upstream.client import UpstreamClient

log = logging.getLogger("prefixgate.app")

# Health checks and scrapes of one gateway at once; their own client, so that they never queue
# behind traffic.
MONITOR_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Gateway:
    """Everything one gateway instance owns; built complete by :func:`build_gateway`."""

    config: GatewayConfig
    pool: EndpointPool
    stores: Stores
    scheduler: Scheduler
    metrics: GatewayMetrics
    flow: FlowController
    router: Router
    proxy: Proxy
    # Where and how request bodies are parsed: the HTTP proxy's and ext_proc's, one object.
    preparer: BodyPreparer
    calibrator: Calibrator
    sizer: IndexSizer
    prediction: PredictionTracker
    monitor: EndpointMonitor
    lag: LoopLagMonitor
    # The proxy's (and the stored-response probe's) client, and the monitor's.
    upstream: UpstreamClient
    monitor_client: UpstreamClient
    # Asks replicas (on the monitor's client) to count prompts whose answers will not.
    token_counts: TokenCounts
    precise: PreciseRuntime | None = None
    discovery: KubernetesDiscovery | None = None
    # Times each endpoint as it comes up (None: off), for the calibrator's speed prior.
    speed_probe: SpeedProbe | None = None


def _build_pool(config: GatewayConfig) -> EndpointPool:
    od = config.pool.outlier_detection
    outliers = OutlierSettings(
        od.consecutive_failures, od.base_ejection_seconds, od.max_ejection_seconds,
        od.max_ejection_percent,
    )
    return EndpointPool(
        (Endpoint.from_url(e.url, e.role, e.models) for e in config.pool.endpoints),
        outliers=outliers if od.enabled else None,
    )


def _log_compatibility(config: GatewayConfig) -> None:
    """Once per gateway: what an llm-d config said that changes nothing here."""
    compat = config.compatibility
    if compat is None:
        return
    for line in compat.ignored:
        log.warning("%s config: accepted but ignored: %s", compat.source, line)


def _build_sizer(
    config: GatewayConfig,
    pool: EndpointPool,
    stores: Stores,
    density: TokenDensity,
    registry: CollectorRegistry,
) -> IndexSizer:
    """Sizes the approximate index per endpoint at the learned bytes per token."""
    index = config.prefix_index
    models = {
        s.endpoint.id: next(iter(s.endpoint.models))
        for s in pool
        if len(s.endpoint.models) == 1
    }
    return IndexSizer(
        stores.index, density, index.block_bytes,
        fixed_blocks=index.capacity_blocks, models=models, pool=pool, registry=registry,
    )


def _capacity_bound(precise: PreciseRuntime | None, sizer: IndexSizer) -> CapacityCallback:
    """Bounds the indexes for an endpoint by what its KV cache can really hold (from a scrape)."""

    def on_capacity(endpoint_id: str, block_size: int, num_gpu_blocks: int) -> None:
        if precise is not None:
            precise.set_capacity(endpoint_id, num_gpu_blocks)
        sizer.kv_capacity(endpoint_id, block_size * num_gpu_blocks)

    return on_capacity


def _restarted(stores: Stores, routing: RoutingGraph) -> Callable[[str, float], Awaitable[None]]:
    """What an endpoint's engine restart empties: its entries in the prefix index, and the
    live sessions' contexts counted in its cache. The index is told the new engine's life
    (its scraped start time): a shared index clears once per life, whichever gateways see it."""

    async def restarted(endpoint_id: str, started: float) -> None:
        await stores.index.clear_endpoint(endpoint_id, repr(started) if started else None)
        routing.live.clear_endpoint(endpoint_id)

    return restarted


def _build_monitor(
    config: GatewayConfig,
    pool: EndpointPool,
    client: UpstreamClient,
    stores: Stores,
    flow: FlowController,
    keys: UpstreamKeys,
    on_capacity: CapacityCallback,
    on_restart: Callable[[str, float], Awaitable[None]],
    on_base_model: Callable[[str, str | None], None],
    speed_probe: SpeedProbe | None,
) -> EndpointMonitor:
    hc, ms = config.pool.health_check, config.pool.metrics_scrape
    settings = MonitorSettings(
        scrape_interval=ms.interval_seconds,
        scrape_timeout=ms.timeout_seconds,
        health_interval=hc.interval_seconds,
        health_timeout=hc.timeout_seconds,
        unhealthy_threshold=hc.unhealthy_threshold,
    )
    shared = stores.shared_in_flight
    return EndpointMonitor(
        pool, client, settings, on_capacity,
        auth_headers=keys.headers,
        remote_load=shared.remote_load if shared else None,
        on_scrape=flow.poke,
        on_restart=on_restart,
        on_base_model=on_base_model,
        on_healthy=speed_probe.endpoint_up if speed_probe is not None else None,
    )


def _build_speed_probe(
    config: GatewayConfig, client: UpstreamClient, calibrator: Calibrator, keys: UpstreamKeys
) -> SpeedProbe | None:
    sp = config.pool.speed_probe
    if not sp.enabled:
        return None
    return SpeedProbe(
        client, calibrator.probed, requests=sp.requests, prompt_bytes=sp.prompt_bytes,
        timeout_s=sp.timeout_seconds, auth_headers=keys.headers,
    )


def _build_discovery(
    config: GatewayConfig,
    pool: EndpointPool,
    monitor: EndpointMonitor,
    stores: Stores,
    routing: RoutingGraph,
    sizer: IndexSizer,
    speed_probe: SpeedProbe | None,
) -> KubernetesDiscovery | None:
    """Kubernetes discovery, wired to everything that follows the pool's joins and leaves."""
    if config.discovery is None:
        return None
    forget: list[Forget] = [
        stores.index.forget_endpoint,
        stores.affinity.forget_endpoint,
        routing.calibrator.forget_endpoint,
        routing.flow.forget_endpoint,
        sizer.forget_endpoint,
    ]
    if speed_probe is not None:
        forget.append(speed_probe.forget_endpoint)
    # Plugins that keep state per endpoint (no-hit-lru-scorer's order), the prefill profile's too.
    forget += endpoint_forgetters([routing.scheduler.profile, routing.prefill_profile])
    joined = []
    if routing.precise is not None:
        forget.append(routing.precise.forget_endpoint)
        joined.append(routing.precise.endpoint_joined)
    return KubernetesDiscovery(config.discovery, LivePool(pool, monitor, forget, joined))


def _build_parser(config: GatewayConfig) -> BodyParser | None:
    """Large bodies' parser; its processes start with the first large body, not here."""
    processes = config.server.offload_processes
    return BodyParser(processes) if processes else None


def build_gateway(
    config: GatewayConfig,
    registry: PluginRegistry | None = None,
    environ: Mapping[str, str] | None = None,
) -> Gateway:
    """The whole graph, every object complete; nothing runs until :func:`gateway_running`."""
    _log_compatibility(config)
    environ = os.environ if environ is None else environ
    pool = _build_pool(config)
    metrics = GatewayMetrics(pool)
    metrics.registry.register(LogDrops())
    keys = build_upstream_keys(config.pool, environ)
    upstream = UpstreamClient(config.proxy.max_connections, config.proxy.connect_timeout_seconds)
    probe = make_probe(upstream, keys.headers, config.responses.probe_timeout_seconds)
    stores = build_stores(config, pool, metrics.registry, probe)
    routing = build_routing(config, registry or default_registry(), pool, stores, metrics)
    precise = routing.precise
    sizer = _build_sizer(config, pool, stores, routing.density, metrics.registry)
    prediction = PredictionTracker(
        metrics.registry,
        config.precise_prefix.block_size,
        precise.tracker if precise else None,
        precise.expect_events if precise else None,
        answers=routing.answers,
        sampler=RateSampler(ANSWERS_READ_PER_S, ANSWERS_READ_BURST),
        lengths=routing.lengths,
    )
    preparer = BodyPreparer(config, routing.router, _build_parser(config))
    hc, ms = config.pool.health_check, config.pool.metrics_scrape
    monitor_client = UpstreamClient(
        MONITOR_CONNECTIONS, max(hc.timeout_seconds, ms.timeout_seconds)
    )
    token_counts = TokenCounts(sizer, monitor_client, lambda e: list(keys.headers(e).items()))
    proxy = Proxy(
        config, routing.router, metrics, upstream, preparer=preparer, upstream_keys=keys,
        auth=build_authenticator(config.auth, environ), prediction=prediction, sizer=sizer,
        token_counts=token_counts, disagg=build_disagg(config, routing, metrics),
    )
    speed_probe = _build_speed_probe(config, monitor_client, routing.calibrator, keys)
    monitor = _build_monitor(
        config, pool, monitor_client, stores, routing.flow, keys, _capacity_bound(precise, sizer),
        _restarted(stores, routing), sizer.base_model, speed_probe,
    )
    return Gateway(
        config, pool, stores, routing.scheduler, metrics, routing.flow, routing.router, proxy,
        preparer, routing.calibrator, sizer, prediction, monitor, LoopLagMonitor(metrics.loop_lag),
        upstream, monitor_client, token_counts, precise,
        _build_discovery(config, pool, monitor, stores, routing, sizer, speed_probe),
        speed_probe,
    )


@asynccontextmanager
async def gateway_running(gateway: Gateway) -> AsyncIterator[None]:
    """The gateway's background work (health and metrics polling, Kubernetes discovery, flow
    control, shared stores, KV events) while the context lasts; shared by every front door's
    lifespan. Starts in order; the stack stops in reverse."""
    async with AsyncExitStack() as stack:
        stack.push_async_callback(gateway.upstream.aclose)
        stack.push_async_callback(gateway.monitor_client.aclose)
        stack.push_async_callback(gateway.token_counts.aclose)  # before its client closes
        stack.push_async_callback(gateway.stores.aclose)
        stack.push_async_callback(gateway.monitor.stop)
        if gateway.precise is not None:
            # Before discovery, which adds (and removes) subscribers as endpoints come and go.
            gateway.precise.start({s.endpoint.id: s.endpoint.url for s in gateway.pool})
            stack.push_async_callback(gateway.precise.stop)
        if gateway.discovery is not None:
            stack.push_async_callback(gateway.discovery.stop)
            await gateway.discovery.start()
        if gateway.speed_probe is not None:
            stack.push_async_callback(gateway.speed_probe.stop)
        await gateway.monitor.check_all()
        if gateway.speed_probe is not None:
            # Not ready before the first placements can know which replicas are slow.
            await gateway.speed_probe.settle(gateway.config.pool.speed_probe.startup_wait_seconds)
        gateway.monitor.start()
        gateway.flow.start()
        stack.push_async_callback(gateway.flow.stop)
        gateway.stores.start()
        parser = gateway.preparer.parser
        if parser is not None:  # its processes start with the first large body
            stack.push_async_callback(parser.aclose)
        gateway.lag.start()
        stack.push_async_callback(gateway.lag.stop)
        # First at exit: streams cut by the drain deadline are still writing their closing
        # event, through the client closed last.
        stack.push_async_callback(gateway.proxy.wait_idle, 1.0)
        yield


def create_app(config: GatewayConfig, registry: PluginRegistry | None = None) -> GatewayApp:
    """The HTTP gateway: its graph, its routes, and a lifespan that runs the graph."""
    gateway = build_gateway(config, registry)

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(gateway_running(gateway))
            except Exception as exc:
                # uvicorn logs it and exits 3: kept for the server to report (router.serve).
                app.state.startup_error = exc
                raise
            yield

    app = GatewayApp(title="prefixgate", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.startup_error = None
    stored = StoredResponses(
        config, gateway.pool, gateway.stores.candidates(gateway.pool), gateway.stores.responses,
        gateway.proxy,
    )
    counting = TokenCounting(
        gateway.pool, gateway.stores.candidates(gateway.pool), gateway.proxy,
        config.proxy.idle_timeout_seconds,
    )
    add_routes(app, gateway.proxy, stored, counting, gateway.pool, gateway.metrics)
    return app
