from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson

from router.api.asgi import GatewayApp
from router.api.routes import (
    add_error_handlers,
    add_inference_routes,
    add_operations_routes,
    add_stored_response_routes,
)

# The wrong-method requests below never reach a handler: nothing is proxied.
UNUSED: Any = None


def _app() -> GatewayApp:
    app = GatewayApp()
    add_error_handlers(app)
    add_inference_routes(app, UNUSED)
    add_stored_response_routes(app, UNUSED)
    return app


async def test_a_wrong_method_is_a_405_naming_the_methods_allowed() -> None:
    """RFC 9110 (15.5.6): a 405 MUST carry ``Allow``; a client (or an SDK's retry logic)
    reads it to learn the right method. Every method the path takes, not only one route's."""
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        chat = await http.get("/v1/chat/completions")
        stored = await http.put("/v1/responses/resp_1")
        cancel = await http.get("/v1/responses/resp_1/cancel")
    for answer in (chat, stored, cancel):
        assert answer.status_code == 405
        error = orjson.loads(answer.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}
    assert chat.headers.get("allow") == "POST"
    assert stored.headers.get("allow") == "DELETE, GET"
    assert cancel.headers.get("allow") == "POST"


class _Pool:
    def __iter__(self) -> Iterator[Any]:
        return iter([SimpleNamespace(healthy=True)])

    def models(self) -> set[str]:
        return {"m"}


async def test_the_operations_routes_answer_head_as_they_answer_get() -> None:
    """RFC 9110 (9.1): a server supports HEAD wherever it supports GET. Load balancers'
    health checks send HEAD (Azure Front Door's default, ``curl -I``): a 405 there reads as
    a gateway that is down."""
    app = GatewayApp()
    add_error_handlers(app)
    proxy = SimpleNamespace(auth=None, draining=False)
    metrics = SimpleNamespace(render=lambda: b"# nothing yet\n")
    add_operations_routes(app, cast(Any, proxy), cast(Any, _Pool()), cast(Any, metrics))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for path in ("/health", "/ready", "/v1/models", "/metrics"):
            get = await http.get(path)
            head = await http.head(path)
            assert get.status_code == 200, path
            assert head.status_code == 200, path
            assert head.headers["content-type"] == get.headers["content-type"]


async def test_errors_on_v1_messages_are_in_anthropics_shape() -> None:
    """/v1/messages answers errors in Anthropic's shape (docs/agent-apis.md): those made
    outside the proxy too, a wrong method or a bug in the gateway. Chat keeps OpenAI's."""

    async def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    app = GatewayApp()
    add_error_handlers(app)
    add_inference_routes(app, cast(Any, SimpleNamespace(handle=broken)))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        wrong_method = await http.get("/v1/messages")
        crashed = await http.post("/v1/messages", json={})
        chat_crashed = await http.post("/v1/chat/completions", json={})
    assert (wrong_method.status_code, crashed.status_code) == (405, 500)
    for answer in (wrong_method, crashed):
        body = orjson.loads(answer.content)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert orjson.loads(crashed.content)["error"]["type"] == "api_error"
    assert orjson.loads(chat_crashed.content)["error"]["type"] == "internal_error"
