"""The gateway's HTTP routes on its ASGI app: the inference routes (served outside FastAPI's
stack), the stored responses of the Responses API, operations (/v1/models, /health, /ready,
/metrics) and the error handlers that give every error an OpenAI-shaped body.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Scope

from router.api.asgi import JSON, ErrorRenderer, GatewayApp, error_response, internal_error
from router.api.count_tokens import PATH as COUNT_TOKENS_PATH
from router.api.count_tokens import TokenCounting
from router.api.proxy import Proxy
from router.api.stored_responses import StoredResponses
from router.core.errors import BadRequestError, GatewayError
from router.core.pool import EndpointPool
from router.pool.metrics import GatewayMetrics
from router.protocol import anthropic
from router.protocol.openapi import openapi_extra

# Anthropic's route: its clients read errors in Anthropic's shape only.
MESSAGES = "/v1/messages"


def add_routes(
    app: GatewayApp,
    proxy: Proxy,
    stored: StoredResponses,
    counting: TokenCounting,
    pool: EndpointPool,
    metrics: GatewayMetrics,
) -> None:
    """Every route of the gateway, on ``app``."""
    add_error_handlers(app)
    add_inference_routes(app, proxy)
    add_stored_response_routes(app, stored)
    add_token_counting_route(app, counting)
    add_operations_routes(app, proxy, pool, metrics)


def add_error_handlers(app: GatewayApp) -> None:
    """Every error leaves as an OpenAI-shaped body, or Anthropic-shaped under /v1/messages."""

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return _shape(request)(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = GatewayError(str(exc.detail))
        error.status_code = exc.status_code
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        response = _shape(request)(error)
        if exc.headers:
            response.headers.update(exc.headers)
        if exc.status_code == 405:  # Starlette's Allow names one route's methods
            response.headers["allow"] = ", ".join(_allowed_methods(app, request.scope))
        return response

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Response:
        # The server's error middleware logs the traceback after this response.
        return internal_error(_shape(request))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _shape(request)(BadRequestError(str(exc.errors())))


def _shape(request: Request) -> ErrorRenderer:
    """Anthropic's error shape for its clients' paths (docs/agent-apis.md), else OpenAI's."""
    path: str = request.scope["path"]
    anthropics = path == MESSAGES or path.startswith(MESSAGES + "/")
    return anthropic.error_response if anthropics else error_response


def _allowed_methods(app: GatewayApp, scope: Scope) -> list[str]:
    """Every method some route takes at the request's path (a 405 must list them all)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if route.matches(scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def add_inference_routes(app: GatewayApp, proxy: Proxy) -> None:
    """The hot routes: served outside FastAPI's stack (router/api/asgi.py)."""

    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "completions")

    async def messages(request: Request) -> Response:
        # This endpoint's clients expect Anthropic's error shape.
        return await proxy.handle(request, "messages", anthropic.error_response)

    async def responses(request: Request) -> Response:
        return await proxy.handle(request, "responses")

    app.hot_route("/v1/chat/completions", chat_completions, openapi_extra=openapi_extra("chat"))
    app.hot_route(
        "/v1/completions", completions, openapi_extra=openapi_extra("completions")
    )
    app.hot_route(MESSAGES, messages, errors=anthropic.error_response)
    app.hot_route("/v1/responses", responses)


def add_stored_response_routes(app: GatewayApp, stored: StoredResponses) -> None:

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await stored.handle(request, response_id, "/cancel")


def add_token_counting_route(app: GatewayApp, counting: TokenCounting) -> None:

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request) -> Response:
        try:
            return await counting.handle(request)
        except GatewayError as exc:  # Anthropic's clients expect its error shape
            return anthropic.error_response(exc)


def add_operations_routes(
    app: GatewayApp, proxy: Proxy, pool: EndpointPool, gateway_metrics: GatewayMetrics
) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if proxy.auth is not None:
            proxy.auth.authenticate(request.headers)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "prefixgate"}
            for m in sorted(pool.models())
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=JSON)

    @app.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    @app.get("/ready")
    async def ready() -> Response:
        healthy = sum(1 for s in pool if s.healthy)
        ready = healthy > 0 and not proxy.draining
        body = orjson.dumps(
            {"ready": ready, "healthy_endpoints": healthy, "draining": proxy.draining}
        )
        return Response(body, 200 if ready else 503, media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway_metrics.render(), media_type="text/plain; version=0.0.4")

    # HEAD wherever GET (RFC 9110 9.1; load balancers probe with it): left out of the schema,
    # where it would only repeat the GET operations.
    gets: list[tuple[str, Callable[..., Awaitable[Response]]]] = [
        ("/v1/models", models), ("/health", health), ("/ready", ready), ("/metrics", metrics)
    ]
    for path, endpoint in gets:
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
