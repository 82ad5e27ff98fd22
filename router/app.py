"""The app factory: builds the gateway's object graph explicitly and hands its lifetime to the
ASGI lifespan (HTTP clients, background tasks, index connections). No module-level state.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import aiohttp
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.responses import Response

from flow_control.controller import FlowController
from router import __version__
from router.api.asgi import JSON, GatewayApp, error_response, internal_error
from router.api.loop_lag import LoopLagMonitor
from router.api.prediction import PredictionTracker
from router.api.proxy import Proxy
from router.api.request_body import BodyParser
from router.api.stored_responses import StoredResponses, make_probe
from router.config.model import (
    GatewayConfig,
    PluginConfig,
    ProfileConfig,
    Strategy,
    builtin_strategy,
)
from router.core.endpoints import Endpoint, EndpointPool, OutlierSettings
from router.core.errors import BadRequestError, GatewayError
from router.core.framework import PickObserver, Producer, Scheduler, SchedulingProfile
from router.estimators.answer_cache import AnswerCache
from router.estimators.calibration import Calibrator
from router.estimators.live_sessions import LiveSessions
from router.estimators.token_density import TokenDensity
from router.index.sizing import IndexSizer
from router.index.stores import Stores, build_stores
from router.pool.discovery import KubernetesDiscovery, LivePool, api_client
from router.pool.metrics import GatewayMetrics
from router.pool.scraper import EndpointMonitor, MonitorSettings
from router.precise.routing import PreciseRouter, PreciseRuntime, precise_enabled
from router.protocol import anthropic
from router.protocol.parsing import openapi_extra
from router.scheduling.disagg import Disaggregator, build_disagg_profiles
from router.scheduling.plugins import PluginContext, PluginRegistry, build_profile, default_registry
from router.scheduling.producers import AffinityTracker, PrefixTracker
from router.scheduling.routing import Router
from router.upstream.client import UpstreamClient

log = logging.getLogger("prefixgate.app")


@dataclass(slots=True)
class Gateway:
    """Everything one gateway instance owns; built by :func:`build_gateway`."""

    config: GatewayConfig
    pool: EndpointPool
    stores: Stores
    scheduler: Scheduler
    metrics: GatewayMetrics
    flow: FlowController
    router: Router
    proxy: Proxy
    calibrator: Calibrator
    sizer: IndexSizer
    monitor: EndpointMonitor | None = None
    discovery: KubernetesDiscovery | None = None
    precise: PreciseRuntime | None = None
    prediction: PredictionTracker | None = None

    def kv_capacity_to_blocks(self, endpoint_id: str, block_size: int, num_gpu_blocks: int) -> None:
        """Bound the index for an endpoint by what its KV cache can really hold."""
        if self.precise is not None:
            self.precise.set_capacity(endpoint_id, num_gpu_blocks)
        self.sizer.kv_capacity(endpoint_id, block_size * num_gpu_blocks)


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


def _plugins(config: GatewayConfig) -> Strategy:
    """The configured plugins and first profile, or the named strategy's."""
    if config.plugins is None:
        return builtin_strategy(config.strategy)
    assert config.scheduling_profiles  # enforced by the config model
    return config.plugins, config.scheduling_profiles[0]


def _build_scheduler(
    config: GatewayConfig,
    plugins: list[PluginConfig],
    profile_cfg: ProfileConfig,
    registry: PluginRegistry,
    context: PluginContext,
    stores: Stores,
    metrics: GatewayMetrics,
    precise: PreciseRuntime | None,
) -> tuple[Scheduler, SchedulingProfile | None]:
    """The scheduler with its producers and observers, and the prefill profile (disaggregated)."""
    prefill_profile: SchedulingProfile | None = None
    if config.disaggregation.enabled:
        profile, prefill_profile = build_disagg_profiles(
            plugins, config.scheduling_profiles or [profile_cfg], registry, context
        )
    else:
        profile = build_profile(plugins, profile_cfg, registry, context)
    prefix = PrefixTracker(stores.index)
    sessions = AffinityTracker(stores.affinity)
    live = LiveSessions(config.session_affinity.max_sessions, registry=metrics.registry)
    producers: list[Producer] = [prefix, sessions, live]
    observers: list[PickObserver] = [prefix, sessions, live]
    if precise is not None:
        producers.append(precise.tracker)
        observers.append(precise.tracker)
    # Scorers that learn from the pick (no-hit-lru-scorer), after the stores have recorded it.
    observers += [ws.scorer for ws in profile.scorers if isinstance(ws.scorer, PickObserver)]
    return Scheduler(profile, producers=producers, observers=observers), prefill_profile


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
        fixed_blocks=index.capacity_blocks, models=models, registry=registry,
    )


def build_gateway(config: GatewayConfig, registry: PluginRegistry | None = None) -> Gateway:
    _log_compatibility(config)
    registry = registry or default_registry()
    pool = _build_pool(config)
    metrics = GatewayMetrics(pool)
    stores = build_stores(config, pool, metrics.registry)
    calibrator = Calibrator(registry=metrics.registry)
    density = TokenDensity(metrics.registry)
    answers = AnswerCache(metrics.registry)
    plugins, profile_cfg = _plugins(config)
    precise = None
    if precise_enabled(config, plugins):
        precise = PreciseRuntime(config, metrics.registry, stores.redis_metrics)
    context = PluginContext(
        random.Random(config.seed), calibrator, precise.tracker if precise else None
    )
    scheduler, prefill_profile = _build_scheduler(
        config, plugins, profile_cfg, registry, context, stores, metrics, precise
    )
    candidates = stores.candidates(pool)
    scrape = config.pool.metrics_scrape
    flow = FlowController(
        config.flow_control,
        candidates,
        registry=metrics.registry,
        scrape_interval=scrape.interval_seconds,
        scrape_timeout=scrape.timeout_seconds,
    )
    if precise is not None:
        router: Router = PreciseRouter(
            config, pool, candidates, scheduler, flow, metrics, tracker=precise.tracker,
            responses=stores.responses, calibrator=calibrator, answers=answers, density=density,
        )
    else:
        router = Router(
            config, pool, candidates, scheduler, flow, metrics, responses=stores.responses,
            calibrator=calibrator, answers=answers, density=density,
        )
    proxy = Proxy(config, router, metrics)
    if prefill_profile is not None:
        pd = config.disaggregation
        timeout = pd.prefill_timeout_seconds or config.proxy.first_byte_timeout_seconds
        proxy.disagg = Disaggregator(pd, router, prefill_profile, metrics, timeout)
    sizer = _build_sizer(config, pool, stores, density, metrics.registry)
    proxy.sizer = sizer
    gateway = Gateway(
        config, pool, stores, scheduler, metrics, flow, router, proxy, calibrator, sizer
    )
    gateway.precise = precise
    gateway.prediction = PredictionTracker(
        metrics.registry,
        config.precise_prefix.block_size,
        precise.tracker if precise else None,
        precise.expect_events if precise else None,
        answers=answers,
    )
    proxy.prediction = gateway.prediction
    return gateway


async def _start_discovery(gateway: Gateway, stack: AsyncExitStack) -> KubernetesDiscovery:
    config = gateway.config.discovery
    assert config is not None
    client, namespace = await asyncio.to_thread(api_client, config)
    await stack.enter_async_context(client)
    forget = [
        gateway.stores.index.forget_endpoint,
        gateway.stores.affinity.forget_endpoint,
        gateway.calibrator.forget_endpoint,
        gateway.flow.forget_endpoint,
        gateway.sizer.forget_endpoint,
    ]
    joined = []
    if gateway.precise is not None:
        forget.append(gateway.precise.forget_endpoint)
        joined.append(gateway.precise.endpoint_joined)
    sink = LivePool(gateway.pool, gateway.monitor, forget, joined)
    discovery = KubernetesDiscovery(config, sink, client, namespace)
    stack.push_async_callback(discovery.stop)
    await discovery.start()
    return discovery


@asynccontextmanager
async def gateway_running(gateway: Gateway) -> AsyncIterator[None]:
    """The gateway's background work (health and metrics polling, Kubernetes discovery, flow
    control, shared stores) while the context lasts; shared by every front door's lifespan.
    Stops in reverse order of start."""
    config = gateway.config
    async with AsyncExitStack() as stack:
        # Monitoring gets its own client, so health checks never queue behind traffic.
        monitor_client = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        )
        hc, ms = config.pool.health_check, config.pool.metrics_scrape
        settings = MonitorSettings(
            scrape_interval=ms.interval_seconds,
            scrape_timeout=ms.timeout_seconds,
            health_interval=hc.interval_seconds,
            health_timeout=hc.timeout_seconds,
            unhealthy_threshold=hc.unhealthy_threshold,
        )
        shared = gateway.stores.shared_in_flight
        monitor = EndpointMonitor(
            gateway.pool, monitor_client, settings, gateway.kv_capacity_to_blocks,
            auth_headers=gateway.proxy.upstream_keys.headers,
            remote_in_flight=shared.remote_in_flight if shared else None,
            on_scrape=gateway.flow.poke,
        )
        gateway.monitor = monitor
        stack.push_async_callback(gateway.stores.aclose)
        stack.push_async_callback(monitor.stop)
        if gateway.precise is not None:
            # Before discovery, which adds (and removes) subscribers as endpoints come and go.
            gateway.precise.start({s.endpoint.id: s.endpoint.url for s in gateway.pool})
            stack.push_async_callback(gateway.precise.stop)
        if config.discovery is not None:
            gateway.discovery = await _start_discovery(gateway, stack)
        await monitor.check_all()
        monitor.start()
        gateway.flow.start()
        stack.push_async_callback(gateway.flow.stop)
        gateway.stores.start()
        if config.server.offload_processes:
            gateway.proxy.parser = BodyParser(config.server.offload_processes)
            stack.push_async_callback(gateway.proxy.parser.aclose)
        lag = LoopLagMonitor(gateway.metrics.loop_lag)
        lag.start()
        stack.push_async_callback(lag.stop)
        yield


def create_app(config: GatewayConfig, registry: PluginRegistry | None = None) -> GatewayApp:
    gateway = build_gateway(config, registry)

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        proxy_cfg = config.proxy
        client = UpstreamClient(proxy_cfg.max_connections, proxy_cfg.connect_timeout_seconds)
        gateway.proxy.client = client
        gateway.stores.responses.probe = make_probe(
            client, gateway.proxy.upstream_keys.headers, config.responses.probe_timeout_seconds
        )
        async with gateway_running(gateway):
            try:
                yield
            finally:
                # Streams cut by the drain deadline are still writing their closing event.
                await gateway.proxy.wait_idle(1.0)
                await client.aclose()

    app = GatewayApp(title="prefixgate", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    _add_error_handlers(app)
    _add_inference_routes(app, gateway)
    _add_stored_response_routes(app, gateway)
    _add_operations_routes(app, gateway)
    return app


def _add_error_handlers(app: GatewayApp) -> None:
    """Every error leaves as an OpenAI-shaped body (the Messages route re-shapes its own)."""

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = GatewayError(str(exc.detail))
        error.status_code = exc.status_code
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(error)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Response:
        # The server's error middleware logs the traceback after this response.
        return internal_error()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(BadRequestError(str(exc.errors())))


def _add_inference_routes(app: GatewayApp, gateway: Gateway) -> None:
    """The hot routes: served outside FastAPI's stack (router/api/asgi.py)."""
    proxy = gateway.proxy

    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    async def messages(request: Request) -> Response:
        try:
            return await proxy.handle(request, "messages")
        except GatewayError as exc:  # this endpoint's clients expect Anthropic's error shape
            return anthropic.error_response(exc)

    async def responses(request: Request) -> Response:
        return await proxy.handle(request, "responses")

    app.hot_route("/v1/chat/completions", chat_completions, openapi_extra=openapi_extra("chat"))
    app.hot_route(
        "/v1/completions", completions, openapi_extra=openapi_extra("completions")
    )
    app.hot_route("/v1/messages", messages)
    app.hot_route("/v1/responses", responses)


def _add_stored_response_routes(app: GatewayApp, gateway: Gateway) -> None:
    stored = StoredResponses(
        gateway.config, gateway.pool, gateway.stores.candidates(gateway.pool),
        gateway.stores.responses, gateway.proxy,
    )

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id, "/cancel")


def _add_operations_routes(app: GatewayApp, gateway: Gateway) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if gateway.proxy.auth is not None:
            gateway.proxy.auth.authenticate(request.headers)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "prefixgate"}
            for m in sorted(gateway.pool.models())
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    @app.get("/ready")
    async def ready() -> Response:
        healthy = sum(1 for s in gateway.pool if s.healthy)
        ready = healthy > 0 and not gateway.proxy.draining
        body = orjson.dumps(
            {"ready": ready, "healthy_endpoints": healthy, "draining": gateway.proxy.draining}
        )
        return Response(body, 200 if ready else 503, media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")
