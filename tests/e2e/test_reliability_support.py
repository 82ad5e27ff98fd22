"""Helpers for the reliability tests: a loopback upstream that records what reaches it, and a
canary that counts every connection made to it (an address no request may ever reach)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.serve.server import bind_socket
from tests.gateways import MODEL


def replica_routes(models_headers: list[dict[str, str]] | None = None) -> list[Route]:
    """What the gateway's monitor asks of a replica: its models (serving ``MODEL``; the
    request headers appended to ``models_headers``), health and metrics."""

    async def models(request: Request) -> Response:
        if models_headers is not None:
            models_headers.append(dict(request.headers))
        return Response(orjson.dumps({"data": [{"id": MODEL}]}), media_type="application/json")

    async def ok(request: Request) -> Response:
        return Response(b"", media_type="text/plain")

    return [Route("/v1/models", models), Route("/health", ok), Route("/metrics", ok)]


@dataclass
class EchoUpstream:
    """An OpenAI-ish upstream answering every completion with the headers it received."""

    url: str = ""
    received: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    models_headers: list[dict[str, str]] = field(default_factory=list)
    # Streams one SSE event, then says nothing more (a replica stuck mid-answer).
    stall_streams: bool = False
    open_streams: int = 0

    def app(self) -> Starlette:
        async def completion(request: Request) -> Response:
            headers = dict(request.headers)
            self.received.append(headers)
            self.bodies.append(await request.body())
            if self.stall_streams:
                return StreamingResponse(self._stalled(), media_type="text/event-stream")
            body = {"id": "x", "object": "chat.completion", "choices": [], "headers": headers}
            return Response(orjson.dumps(body), media_type="application/json")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", completion, methods=["POST"]),
                Route("/v1/completions", completion, methods=["POST"]),
                *replica_routes(self.models_headers),
            ]
        )

    async def _stalled(self) -> AsyncIterator[bytes]:
        self.open_streams += 1
        try:
            yield b'data: {"choices": []}\n\n'
            await asyncio.sleep(3600)
        finally:
            self.open_streams -= 1


@contextlib.asynccontextmanager
async def serve_app(app: Starlette) -> AsyncIterator[str]:
    """Serve an ASGI app on an ephemeral loopback port; yields its base URL."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    server.config.timeout_graceful_shutdown = 1
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (set by uvicorn's task)
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(5):
                await task
        except TimeoutError:
            task.cancel()
        sock.close()


@contextlib.asynccontextmanager
async def echo_upstream() -> AsyncIterator[EchoUpstream]:
    echo = EchoUpstream()
    async with serve_app(echo.app()) as url:
        echo.url = url
        yield echo


class Canary:
    """A listening socket that counts the connections made to it."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Canary:
        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self._server = await asyncio.start_server(connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def test_echo_upstream_and_canary_work() -> None:
    async with echo_upstream() as echo, Canary() as canary, httpx.AsyncClient() as http:
        resp = await http.post(f"{echo.url}/v1/completions", headers={"x-probe": "1"}, json={})
        assert resp.json()["headers"]["x-probe"] == "1"
        assert echo.received[-1]["x-probe"] == "1"
        with contextlib.suppress(httpx.HTTPError):
            await http.get(f"http://{canary.address}/")
        assert canary.connections == 1
