"""Requests naming a stored response of the Responses API: ``GET``/``DELETE
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the endpoint holding it
(:class:`StoredResponses`), and :func:`make_probe` finds that endpoint by asking when the
gateway has no record of the id (:mod:`router.index.response_store`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response

from router.api.asgi import error_response
from router.api.passthrough import pass_through
from router.api.proxy import Proxy
from router.config.model import GatewayConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import GatewayError
from router.core.pool import EndpointPool
from router.index.response_store import Probe, ResponseRoutes
from router.protocol import responses_api
from router.protocol.headers import REQUEST_ID_HEADER, request_id_of
from router.upstream.client import UPSTREAM_ERRORS, UpstreamClient

Candidates = Callable[[str], list[EndpointSnapshot]]


def make_probe(
    client: UpstreamClient, headers: Callable[[str], Mapping[str, str]], timeout: float
) -> Probe:
    """``GET /v1/responses/{id}`` on one endpoint: True when it holds the response, False when
    it says it does not (404), None when it does not say (an error, a timeout)."""

    async def probe(endpoint: EndpointSnapshot, response_id: str) -> bool | None:
        url = f"{endpoint.url}/v1/responses/{response_id}"
        reply = None
        try:
            async with asyncio.timeout(timeout):
                reply = await client.request("GET", url, list(headers(endpoint.id).items()))
                return True if reply.status == 200 else False if reply.status == 404 else None
        except UPSTREAM_ERRORS:
            return None
        finally:
            if reply is not None:
                reply.close()

    return probe


def _healthy(pool: EndpointPool, candidates: Candidates) -> list[EndpointSnapshot]:
    found = {c.id: c for model in sorted(pool.models()) for c in candidates(model)}
    return list(found.values())


class StoredResponses:
    """``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: forwarded
    to the endpoint holding the response and relayed as they come (a ``GET ...?stream=true``
    of a background response streams), without flow control: they are cheap reads."""

    def __init__(
        self,
        config: GatewayConfig,
        pool: EndpointPool,
        candidates: Candidates,
        routes: ResponseRoutes,
        proxy: Proxy,
    ) -> None:
        self._config = config
        self._pool = pool
        self._candidates = candidates
        self._routes = routes
        self._proxy = proxy

    async def handle(self, request: Request, response_id: str, suffix: str = "") -> Response:
        request_id = request_id_of(request.headers)
        try:
            return await self._forward(request, response_id, suffix, request_id)
        except GatewayError as exc:  # returned with the request's id, as every answer is
            refusal = error_response(exc)
            refusal.headers[REQUEST_ID_HEADER] = request_id
            return refusal

    async def _forward(
        self, request: Request, response_id: str, suffix: str, request_id: str
    ) -> Response:
        proxy = self._proxy
        tenant = proxy.auth.authenticate(request.headers) if proxy.auth is not None else None
        body = await proxy.read_body(request) if request.method == "POST" else b""
        healthy = _healthy(self._pool, self._candidates)
        endpoint_id = await self._routes.resolve(response_id, self._pool, healthy)
        endpoint = next(c for c in healthy if c.id == endpoint_id)
        url = f"{endpoint.url}/v1/responses/{response_id}{suffix}"
        upstream_headers = proxy.upstream_headers(request, request_id, tenant, endpoint_id)
        response = await pass_through(
            proxy, self._pool, request, endpoint_id, url, upstream_headers, body, request_id,
            "the endpoint holding the response", self._config.proxy.idle_timeout_seconds,
            error_event=responses_api.stream_error_event,
        )
        if request.method == "DELETE" and response.status_code == 200:
            self._routes.forget(response_id)
        return response
