from __future__ import annotations

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.asgi import GatewayApp
from router.core.errors import SaturatedError


class Counting:
    """A middleware that counts the requests the framework's stack saw."""

    seen: list[str] = []

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            Counting.seen.append(scope["path"])
        await self.app(scope, receive, send)


def _app() -> GatewayApp:
    app = GatewayApp()
    app.add_middleware(Counting)

    async def echo(request: Request) -> Response:
        body = await request.body()
        return Response(body, headers={"x-app": type(request.scope["app"]).__name__})

    async def limited(request: Request) -> Response:
        raise SaturatedError("slow down", retry_after=2)

    async def crash(request: Request) -> Response:
        raise RuntimeError("bug")

    app.hot_route("/echo", echo)
    app.hot_route("/limited", limited)
    app.hot_route("/crash", crash)

    @app.get("/cold")
    async def cold() -> Response:
        return Response(b"cold")

    return app


@pytest.fixture
def http() -> httpx.AsyncClient:
    Counting.seen = []
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_hot_routes_skip_the_framework_stack(http: httpx.AsyncClient) -> None:
    async with http:
        hot = await http.post("/echo", content=b"hello")
        cold = await http.get("/cold")
    assert (hot.status_code, hot.content, hot.headers["x-app"]) == (200, b"hello", "GatewayApp")
    assert cold.content == b"cold"
    assert Counting.seen == ["/cold"], "only the cold route went through the middleware"


async def test_other_methods_and_paths_are_the_frameworks(http: httpx.AsyncClient) -> None:
    async with http:
        wrong_method = await http.get("/echo")
        unknown = await http.post("/echo/more")
    assert wrong_method.status_code == 405
    assert unknown.status_code == 404
    assert Counting.seen == ["/echo", "/echo/more"]


async def test_errors_keep_their_shape_status_and_headers(http: httpx.AsyncClient) -> None:
    async with http:
        limited = await http.post("/limited")
        crashed = await http.post("/crash")
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "2"
    assert orjson.loads(limited.content)["error"]["message"] == "slow down"
    assert crashed.status_code == 500
    assert orjson.loads(crashed.content)["error"]["type"] == "internal_error"


async def test_a_crash_is_re_raised_for_the_server_to_log() -> None:
    app = _app()
    transport = httpx.ASGITransport(app=app)  # raises what the app raises
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        with pytest.raises(RuntimeError, match="bug"):
            await http.post("/crash")
