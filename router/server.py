"""Running the gateway under uvicorn: blocking for the CLI, or in-process for tests and demos."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from router.app import Gateway, create_app
from router.config import GatewayConfig


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    # "auto" picks uvloop and httptools when installed (they are, via uvicorn[standard]).
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="auto",
        http="auto",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=30,
    )


def serve(config: GatewayConfig, log_level: str = "info") -> None:
    app = create_app(config)
    uvicorn.Server(uvicorn_config(app, config.server.host, config.server.port, log_level)).run()


@dataclass(frozen=True, slots=True)
class RunningGateway:
    url: str
    port: int
    gateway: Gateway


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@contextlib.asynccontextmanager
async def running_gateway(
    config: GatewayConfig, log_level: str = "warning", startup_timeout: float = 10.0
) -> AsyncIterator[RunningGateway]:
    """Serve the gateway on a loopback port (0 = ephemeral) inside the current event loop."""
    app = create_app(config)
    sock = bind_socket(config.server.host, config.server.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, config.server.host, port, log_level))
    server.config.timeout_graceful_shutdown = 2
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(startup_timeout):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("gateway exited during start-up")
                await asyncio.sleep(0.01)
        yield RunningGateway(f"http://{config.server.host}:{port}", port, app.state.gateway)
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await task
        except TimeoutError:
            task.cancel()
        finally:
            sock.close()
