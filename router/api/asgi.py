"""The gateway's ASGI application: FastAPI, except on the inference routes.

FastAPI runs every request through its middleware stack (error handling, exception telemetry,
body limits, an exit stack), its router's path matching and its dependency solving, each a
coroutine or more per request; for a proxy answering in a millisecond that was a fifth of its
CPU. The inference routes take the raw request and answer a ready ``Response``, so they need
none of it: :class:`GatewayApp` serves them itself, with the same error translation the
framework's handlers do, and hands every other request (operations, stored responses, wrong
methods, unknown paths, lifespan) to FastAPI unchanged. The hot routes stay registered with
FastAPI too, so the OpenAPI schema and the 405 for a wrong method are the framework's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.core.errors import GatewayError

JSON = "application/json"
Handler = Callable[[Request], Awaitable[Response]]
# A gateway error as an API's clients expect it (OpenAI's shape, or Anthropic's on /v1/messages).
ErrorRenderer = Callable[[GatewayError], Response]


def error_response(error: GatewayError) -> Response:
    """An OpenAI-shaped error body with the error's status and headers."""
    return Response(error.body(), error.status_code, dict(error.headers()), media_type=JSON)


def internal_error(render: ErrorRenderer = error_response) -> Response:
    # A bug, not the client's fault: it still gets an error in its API's shape.
    return render(GatewayError("internal error in the gateway"))


class GatewayApp(FastAPI):
    """FastAPI with a short path for the routes registered by :meth:`hot_route`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot: dict[str, tuple[Handler, ErrorRenderer]] = {}

    def hot_route(
        self, path: str, handler: Handler, errors: ErrorRenderer = error_response, **route: Any
    ) -> None:
        """Serve ``POST path`` with ``handler`` outside the framework's stack, its errors
        rendered by ``errors``; ``route`` goes to FastAPI's own registration (the schema,
        other methods)."""
        self._hot[path] = (handler, errors)
        self.add_api_route(path, handler, methods=["POST"], **route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            hot = self._hot.get(scope["path"])
            if hot is not None:
                scope["app"] = self
                await _serve(*hot, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def _serve(
    handler: Handler, errors: ErrorRenderer, scope: Scope, receive: Receive, send: Send
) -> None:
    """What the framework's exception handlers do, for a handler that returns a Response:
    a GatewayError is answered with its own body; anything else with a 500 in the same shape,
    then re-raised so the server logs the traceback (as Starlette's error middleware does)."""
    try:
        response = await handler(Request(scope, receive))
    except GatewayError as exc:
        response = errors(exc)
    except Exception:
        await internal_error(errors)(scope, receive, send)
        raise
    await response(scope, receive, send)
