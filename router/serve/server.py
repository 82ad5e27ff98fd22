"""Running the gateway under uvicorn: blocking for the CLI, or in-process for tests and demos.

Graceful shutdown, on the first SIGTERM or SIGINT: /ready answers 503 at once; new connections
are still accepted for ``server.shutdownDelaySeconds`` (load balancers take a moment to stop
sending), then the listening socket closes and in-flight requests drain for up to
``server.drainTimeoutSeconds``. Streams still open then end with an SSE error event, requests
still waiting get a 503, and the process exits 0. A second signal exits at once. From the first
signal on, each answer carries ``connection: close`` and ends its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG

from router.api.asgi import GatewayApp
from router.api.logs import LogFormat, configure_logging
from router.api.streaming import ServerSend
from router.app import Gateway, create_app
from router.config.model import GatewayConfig
from router.core.errors import ConfigError
from router.core.heap import freeze_startup_heap
from router.serve.http_protocol import GatewayHttpProtocol

log = logging.getLogger("prefixgate.server")
CONNECTION_CLOSE = (b"connection", b"close")
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def uvicorn_config(
    app: ASGIApp,
    host: str,
    port: int,
    log_level: str = "info",
    own_logging: bool = False,
    keep_alive_seconds: float = 30.0,
) -> uvicorn.Config:
    # uvloop and httptools come with uvicorn[standard]; the protocol is httptools' own with
    # a response's head and first body part written at once.
    return uvicorn.Config(
        ServerSend(app),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="auto",
        http=GatewayHttpProtocol,
        # The gateway never reads the client's address: no X-Forwarded-For layer per request.
        proxy_headers=False,
        # uvicorn types it int but times it with a float (server.keepAliveSeconds).
        timeout_keep_alive=keep_alive_seconds,  # type: ignore[arg-type]
        timeout_graceful_shutdown=30,
        # Our own handlers (text or JSON, off the event loop) instead of uvicorn's.
        log_config=None if own_logging else LOGGING_CONFIG,
    )


class GatewayServer(uvicorn.Server):
    """uvicorn with the gateway's drain sequence instead of an immediate stop on a signal."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._delay = gateway.config.server.shutdown_delay_seconds

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal after its shutdown, which makes the exit code 143:
        # handle the signals here instead, so that a drained shutdown exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.drain)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def drain(self) -> None:
        """Start the shutdown sequence; a second call exits without waiting."""
        proxy = self.gateway.proxy
        if proxy.draining:
            log.warning("second signal: exiting without waiting for in-flight requests")
            self.should_exit = self.force_exit = True
            return
        proxy.draining = True
        self._close_after_responses()
        log.info(
            "draining: not ready; refusing connections in %.1fs; %d request(s) in flight",
            self._delay, proxy.active,
        )
        loop = asyncio.get_running_loop()
        loop.call_later(self._delay, self._stop_accepting)

    def _stop_accepting(self) -> None:
        self.should_exit = True

    def _close_after_responses(self) -> None:
        """While draining, every answer says ``connection: close`` and ends its connection: a
        kept-alive one would bring its client back until the delay ends, then be closed under a
        request it may be sending. uvicorn adds the default headers to each response it starts,
        from a list that cycles share; requests already running get it through their cycle."""
        self._add_connection_close()
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False

    def _add_connection_close(self) -> None:
        headers = self.server_state.default_headers
        if CONNECTION_CLOSE not in headers:
            headers.append(CONNECTION_CLOSE)  # in place: the list the current cycles hold

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if self.gateway.proxy.draining:  # uvicorn renews its default headers once a second
            self._add_connection_close()
        return should_exit


def set_drain_timeout(config: uvicorn.Config, drain_timeout: float) -> None:
    # uvicorn takes whole seconds in its type hints but waits with a float.
    config.timeout_graceful_shutdown = drain_timeout  # type: ignore[assignment]


def run_server(server: GatewayServer, app: GatewayApp, sock: socket.socket) -> None:
    """Serve until stopped. uvicorn exits 3 when the lifespan fails to start; a configuration
    error found there (Kubernetes discovery outside a cluster) is raised as itself instead, so
    that the CLI reports it in one line with exit 2 and a worker exits 2, not in a crash loop."""
    try:
        server.run(sockets=[sock])
    except SystemExit:
        error = app.state.startup_error
        if isinstance(error, ConfigError):
            raise error from None
        raise


def serve(
    config: GatewayConfig, log_level: str = "info", log_format: LogFormat | None = None
) -> None:
    stop_logging = configure_logging(log_level, log_format or config.server.log_format)
    try:
        app = create_app(config)
        server_cfg = config.server
        ucfg = uvicorn_config(
            app,
            server_cfg.host,
            server_cfg.port,
            log_level,
            own_logging=True,
            keep_alive_seconds=server_cfg.keep_alive_seconds,
        )
        set_drain_timeout(ucfg, server_cfg.drain_timeout_seconds)
        sock = bind_socket(server_cfg.host, server_cfg.port)
        freeze_startup_heap()
        run_server(GatewayServer(ucfg, app.state.gateway), app, sock)
    finally:
        stop_logging()


@dataclass(frozen=True, slots=True)
class RunningGateway:
    url: str
    port: int
    gateway: Gateway
    server: GatewayServer | None = None


def bind_socket(host: str = "127.0.0.1", port: int = 0, reuse_port: bool = False) -> socket.socket:
    """The listening socket; with ``reuse_port`` one of several on the same port, each with its
    own accept queue that the kernel spreads new connections over (``--workers``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted connections inherit it: without it the first SSE chunk, written right after the
    # response headers, waits for the client's delayed ACK (~40 ms on Linux).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:  # the usual start-up failure: one line, not a trace
            raise ConfigError(
                f"server.port: {host}:{port} is in use by another process "
                "(a gateway still draining, or a second one)"
            ) from exc
        raise
    sock.set_inheritable(True)
    return sock


class _InProcessServer(GatewayServer):
    """Leaves the host process's signals alone (tests, demos)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn's exit on a failed lifespan: not the host process's
            self.should_exit = True


@contextlib.asynccontextmanager
async def running_gateway(
    config: GatewayConfig, log_level: str = "warning", startup_timeout: float = 10.0
) -> AsyncIterator[RunningGateway]:
    """Serve the gateway on a loopback port (0 = ephemeral) inside the current event loop."""
    app = create_app(config)
    sock = bind_socket(config.server.host, config.server.port)
    port = sock.getsockname()[1]
    keep_alive = config.server.keep_alive_seconds
    ucfg = uvicorn_config(app, config.server.host, port, log_level, keep_alive_seconds=keep_alive)
    server = _InProcessServer(ucfg, app.state.gateway)
    set_drain_timeout(server.config, min(2.0, config.server.drain_timeout_seconds))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(startup_timeout):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("gateway exited during start-up") from (
                        app.state.startup_error
                    )
                await asyncio.sleep(0.01)
        yield RunningGateway(
            f"http://{config.server.host}:{port}", port, app.state.gateway, server
        )
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await task
        except TimeoutError:
            task.cancel()
        finally:
            sock.close()
