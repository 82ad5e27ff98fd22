"""The app factory: builds the gateway's object graph explicitly and hands its lifetime to the
ASGI lifespan (HTTP clients, background tasks, index connections). No module-level state.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from flow_control.controller import FlowController
from router import __version__
from router.config import GatewayConfig
from router.endpoints import Endpoint, EndpointPool
from router.errors import BadRequestError, GatewayError
from router.hashing import BYTES_PER_TOKEN
from router.metrics import GatewayMetrics
from router.plugins import PluginContext, PluginRegistry, build_profile, default_registry
from router.producers import AffinityTracker, PrefixTracker
from router.proxy import Proxy
from router.routing import Router
from router.scheduling import Scheduler
from router.scraper import EndpointMonitor, MonitorSettings
from router.stores import Stores, build_stores
from router.strategies import strategy
from router.upstream import UpstreamClient

JSON = "application/json"


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
    monitor: EndpointMonitor | None = None

    def kv_capacity_to_blocks(self, endpoint_id: str, block_size: int, num_gpu_blocks: int) -> None:
        """Bound the index for an endpoint by what its KV cache can really hold."""
        if self.config.prefix_index.capacity_blocks is not None:
            return
        capacity_bytes = block_size * num_gpu_blocks * BYTES_PER_TOKEN
        blocks = int(capacity_bytes // self.config.prefix_index.block_bytes)
        self.stores.index.set_capacity(endpoint_id, blocks)


def build_gateway(config: GatewayConfig, registry: PluginRegistry | None = None) -> Gateway:
    registry = registry or default_registry()
    rng = random.Random(config.seed)
    pool = EndpointPool(
        Endpoint.from_url(e.url, e.role, e.models) for e in config.pool.endpoints
    )
    metrics = GatewayMetrics(pool)
    stores = build_stores(config, pool, metrics.registry)
    if config.plugins is None:
        plugins, profile_cfg = strategy(config.strategy)
    else:
        assert config.scheduling_profiles  # enforced by the config model
        plugins, profile_cfg = config.plugins, config.scheduling_profiles[0]
    profile = build_profile(plugins, profile_cfg, registry, PluginContext(rng))
    prefix = PrefixTracker(stores.index)
    sessions = AffinityTracker(stores.affinity)
    scheduler = Scheduler(profile, producers=[prefix, sessions], observers=[prefix, sessions])
    candidates = stores.candidates(pool)
    flow = FlowController(config.flow_control, candidates, registry=metrics.registry)
    router = Router(config, pool, candidates, scheduler, flow, metrics)
    proxy = Proxy(config, router, metrics)
    return Gateway(config, pool, stores, scheduler, metrics, flow, router, proxy)


def _error_response(error: GatewayError) -> Response:
    return Response(error.body(), error.status_code, dict(error.headers()), media_type=JSON)


def create_app(config: GatewayConfig, registry: PluginRegistry | None = None) -> FastAPI:
    gateway = build_gateway(config, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        proxy_cfg = config.proxy
        client = UpstreamClient(proxy_cfg.max_connections, proxy_cfg.connect_timeout_seconds)
        # Monitoring gets its own client, so health checks never queue behind traffic.
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as monitor_client:
            gateway.proxy.client = client
            hc, ms = config.pool.health_check, config.pool.metrics_scrape
            settings = MonitorSettings(
                scrape_interval=ms.interval_seconds,
                scrape_timeout=ms.timeout_seconds,
                health_interval=hc.interval_seconds,
                health_timeout=hc.timeout_seconds,
                unhealthy_threshold=hc.unhealthy_threshold,
            )
            monitor = EndpointMonitor(
                gateway.pool, monitor_client, settings, gateway.kv_capacity_to_blocks
            )
            gateway.monitor = monitor
            await monitor.check_all()
            monitor.start()
            gateway.flow.start()
            gateway.stores.start()
            try:
                yield
            finally:
                await gateway.flow.stop()
                await monitor.stop()
                await client.aclose()
                await gateway.stores.aclose()

    app = FastAPI(title="prefixgate", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = GatewayError(str(exc.detail))
        error.status_code = exc.status_code
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(BadRequestError(str(exc.errors())))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.proxy.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.proxy.handle(request, "completions")

    @app.get("/v1/models")
    async def models() -> Response:
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
        body = orjson.dumps({"ready": healthy > 0, "healthy_endpoints": healthy})
        return Response(body, 200 if healthy else 503, media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
