"""One worker process of ``prefixgate serve --workers N`` (the supervisor is
router/serve/supervisor.py).

A worker is the single-process gateway with three differences: its listening socket is one of
several on the port (SO_REUSEPORT: the kernel spreads new connections over the workers' accept
queues), its /metrics answers for every worker (router/serve/worker_metrics.py), and its signals:
SIGTERM and SIGINT start the drain and repeats are harmless (a terminal's Ctrl-C or systemd
reach the workers as well as the supervisor, which forwards the same signal), while SIGQUIT,
sent by the supervisor on a second signal, exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from router.api.logs import LogFormat, configure_logging
from router.app import Gateway, create_app
from router.config.model import GatewayConfig
from router.core.heap import freeze_startup_heap
from router.serve.server import (
    GatewayServer,
    bind_socket,
    run_server,
    set_drain_timeout,
    uvicorn_config,
)
from router.serve.worker_metrics import FleetMetrics

log = logging.getLogger("prefixgate.worker")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Which of the supervisor's ``count`` workers this is, and where they meet."""

    index: int
    count: int
    run_dir: Path


class WorkerServer(GatewayServer):
    """The gateway's server with a worker's signals and its metrics socket."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, fleet: FleetMetrics) -> None:
        super().__init__(config, gateway)
        self._fleet = fleet

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGTERM: self._drain_once, signal.SIGINT: self._drain_once,
                    signal.SIGQUIT: self._exit_now}
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
        try:
            yield
        finally:
            for sig in handlers:
                loop.remove_signal_handler(sig)

    def _drain_once(self) -> None:
        if not self.gateway.proxy.draining:
            self.drain()

    def _exit_now(self) -> None:
        log.warning("told to exit without waiting for in-flight requests")
        self.should_exit = self.force_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        async with self._fleet.serving():
            await super().serve(sockets)


def _die_with_parent(parent: int) -> None:
    """Linux: drain (SIGTERM) when the supervisor dies, even by SIGKILL, instead of serving on
    as an orphan; elsewhere the worker notices nothing and the port keeps a stray listener."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def run_worker(
    config: GatewayConfig, slot: WorkerSlot, parent: int, log_level: str,
    log_format: LogFormat | None,
) -> None:
    """Serve until drained; runs in the forked child, whose caller exits with os._exit."""
    _die_with_parent(parent)
    stop_logging = configure_logging(log_level, log_format or config.server.log_format)
    try:
        app = create_app(config)
        gateway: Gateway = app.state.gateway
        server_cfg = config.server
        fleet = FleetMetrics(app, gateway.metrics.render, slot.run_dir, slot.index, slot.count)
        ucfg = uvicorn_config(
            fleet,
            server_cfg.host,
            server_cfg.port,
            log_level,
            own_logging=True,
            keep_alive_seconds=server_cfg.keep_alive_seconds,
        )
        set_drain_timeout(ucfg, server_cfg.drain_timeout_seconds)
        sock = bind_socket(server_cfg.host, server_cfg.port, reuse_port=True)
        freeze_startup_heap()
        log.info("worker %d of %d serving (pid %d)", slot.index, slot.count, os.getpid())
        run_server(WorkerServer(ucfg, gateway, fleet), app, sock)
    finally:
        stop_logging()
        if os.getppid() != parent:  # the supervisor was killed: nobody else will clean up
            shutil.rmtree(slot.run_dir, ignore_errors=True)
