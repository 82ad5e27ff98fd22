"""The gateway's server: ``running_gateway`` (the in-process server of tests and the demo) on a
start-up that fails, and what a drain does to kept-alive connections."""

from __future__ import annotations

import asyncio
import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from router.core.errors import ConfigError
from router.serve.server import _InProcessServer, bind_socket, running_gateway, uvicorn_config
from tests.gateways import gateway_config


async def test_a_failed_start_up_raises_in_the_caller_instead_of_exiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn exits 3 when the lifespan fails; in-process that must not be the host's
    SystemExit but the documented RuntimeError, caused by what failed."""
    for name in [k for k in os.environ if k.startswith("KUBERNETES_")]:
        monkeypatch.delenv(name)
    config = gateway_config([], discovery={"inferencePool": "pool"})
    with pytest.raises(RuntimeError, match="exited during start-up") as failed:
        async with running_gateway(config):
            pass
    assert isinstance(failed.value.__cause__, ConfigError)


def _stub_gateway(delay: float) -> Any:
    """What GatewayServer reads of the gateway: the shutdown delay and the proxy's drain flag."""
    server = SimpleNamespace(shutdown_delay_seconds=delay)
    return SimpleNamespace(config=SimpleNamespace(server=server),
                           proxy=SimpleNamespace(draining=False, active=0))


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> bytes:
    writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert await reader.readexactly(2) == b"{}"
    return head.lower()


async def test_while_draining_every_response_closes_its_connection() -> None:
    """During ``shutdownDelaySeconds`` the gateway still answers, but a kept-alive connection
    would bring the client back here until the delay ends and uvicorn closes it under a request
    the client may be sending. ``connection: close`` on each answer ends it cleanly instead, and
    the client's next connection goes where the load balancer now sends it."""
    release, running = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            running.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    sock = bind_socket()
    port = sock.getsockname()[1]
    server = _InProcessServer(
        uvicorn_config(app, "127.0.0.1", port, log_level="warning"), _stub_gateway(3600.0)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            kept = await asyncio.open_connection("127.0.0.1", port)
            assert b"connection: close" not in await _get(*kept, "/before")
            busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
            busy_writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            await running.wait()
            server.drain()
            assert b"connection: close" in await _get(*kept, "/after")
            assert await kept[0].read() == b""
            release.set()
            head = (await busy_reader.readuntil(b"\r\n\r\n")).lower()
            assert b"connection: close" in head, "a request in flight when the drain began"
            assert await busy_reader.readexactly(2) == b"{}" and await busy_reader.read() == b""
            await server.on_tick(0)  # uvicorn renews its default headers once a second
            fresh = await asyncio.open_connection("127.0.0.1", port)
            assert b"connection: close" in await _get(*fresh, "/new")
            for _, writer in (kept, fresh, (busy_reader, busy_writer)):
                writer.close()
    finally:
        release.set()
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_in_use_is_a_one_line_error_naming_the_setting(reuse_port: bool) -> None:
    """Another process on the port (an old gateway still draining, a second one started by
    mistake) is the usual start-up failure: the CLI reports a ConfigError in one line with exit
    2, where an OSError is a traceback ending in ``[Errno 98]``."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"server\.port: 127\.0\.0\.1:{port} is in use"):
            bind_socket("127.0.0.1", port, reuse_port=reuse_port)


async def test_the_gateway_serves_with_the_configured_keep_alive() -> None:
    """Wired from ``server.keepAliveSeconds`` through the composition root to the server."""
    config = gateway_config([], server={"port": 0, "keepAliveSeconds": 75})
    async with running_gateway(config) as gw:
        assert gw.server is not None
        assert gw.server.config.timeout_keep_alive == 75
