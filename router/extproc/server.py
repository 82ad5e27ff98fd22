"""``prefixgate epp``: the ext_proc gRPC server, gRPC health and Prometheus metrics, on GIE's
ports (9002, 9003, 9090), around one gateway object graph and its background work.

Health answers for ``liveness`` (the process is up), ``readiness``, the empty service name and
``envoy.service.ext_proc.v3.ExternalProcessor`` (ready: the picker serves and, with Kubernetes
discovery, has listed the pool's pods). Shutdown turns every service NOT_SERVING first, keeps
taking streams for ``shutdownDrainSeconds`` while Envoy and the kubelet notice, then refuses
new ones and gives open streams (answers still relayed) ``shutdownGraceSeconds``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from router.app import Gateway, build_gateway, gateway_running
from router.config.model import GatewayConfig
from router.core.heap import freeze_startup_heap
from router.core.tasks import cancel_and_wait
from router.extproc.service import ExtProcService
from router.scheduling.plugins import PluginRegistry

log = logging.getLogger("prefixgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class RunningEpp:
    port: int
    health_port: int
    metrics_port: int
    gateway: Gateway
    health: HealthServicer

    @property
    def target(self) -> str:
        return f"{self.gateway.config.ext_proc.host}:{self.port}"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _grpc_server(max_message: int) -> grpc.aio.Server:
    return grpc.aio.server(
        options=[
            # A BUFFERED body comes in one message: allow the gateway's body limit.
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            # gRPC sets SO_REUSEPORT by default: a second picker on a taken port must fail.
            ("grpc.so_reuseport", 0),
        ]
    )


async def _start_metrics(gateway: Gateway, stack: AsyncExitStack) -> int:
    async def metrics(request: web.Request) -> web.Response:
        body = gateway.metrics.render()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    cfg = gateway.config.ext_proc
    site = web.TCPSite(runner, cfg.host, cfg.metrics_port)
    await site.start()
    port: int = runner.addresses[0][1]
    return port


async def _start_health(config: GatewayConfig, stack: AsyncExitStack) -> tuple[HealthServicer, int]:
    health = HealthServicer()
    await health.set("liveness", SERVING)
    for service in READY_SERVICES:
        await health.set(service, NOT_SERVING)
    server = _grpc_server(4 * 1024 * 1024)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(_address(config.ext_proc.host, config.ext_proc.health_port))
    await server.start()
    stack.push_async_callback(server.stop, 0)
    return health, port


async def _ready_when_synced(gateway: Gateway, health: HealthServicer) -> None:
    if gateway.discovery is not None:
        await gateway.discovery.wait_synced()
    for service in READY_SERVICES:
        await health.set(service, SERVING)
    log.info("endpoint picker ready (%d endpoints)", len(gateway.pool))


@asynccontextmanager
async def running_epp(
    config: GatewayConfig, registry: PluginRegistry | None = None
) -> AsyncIterator[RunningEpp]:
    """The endpoint picker on its ports (0 = ephemeral) inside the current event loop."""
    gateway = build_gateway(config, registry)
    cfg = config.ext_proc
    async with AsyncExitStack() as stack:
        # Liveness first: discovery's first listing may take a while, and that is not death.
        health, health_port = await _start_health(config, stack)
        stack.push_async_callback(health.enter_graceful_shutdown)
        await stack.enter_async_context(gateway_running(gateway))
        metrics_port = await _start_metrics(gateway, stack)
        server = _grpc_server(config.server.max_body_bytes + 1024 * 1024)
        service = ExtProcService(gateway, cfg)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(service, server)
        port = server.add_insecure_port(_address(cfg.host, cfg.port))
        await server.start()
        stack.push_async_callback(server.stop, cfg.shutdown_grace_seconds)
        # Run first at exit: stop being ready, then keep taking streams while Envoy and the
        # kubelet notice, before the server refuses new ones.
        stack.push_async_callback(asyncio.sleep, cfg.shutdown_drain_seconds)
        stack.push_async_callback(health.enter_graceful_shutdown)
        ready = asyncio.create_task(_ready_when_synced(gateway, health))
        stack.push_async_callback(cancel_and_wait, ready)
        yield RunningEpp(port, health_port, metrics_port, gateway, health)


async def _serve(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running_epp(config) as epp:
        log.info(
            "prefixgate epp: ext_proc on %s, health on %d, metrics on %d",
            epp.target,
            epp.health_port,
            epp.metrics_port,
        )
        await stop.wait()
        log.info(
            "shutting down: draining streams for up to %.0fs",
            config.ext_proc.shutdown_grace_seconds,
        )


def serve_epp(config: GatewayConfig) -> None:
    """Run the endpoint picker until SIGTERM or SIGINT (the CLI's ``epp`` command)."""
    freeze_startup_heap()  # the imports' objects; the picker itself is built in _serve
    asyncio.run(_serve(config))
