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

from router.api.proxy import Proxy
from router.api.streaming import DisconnectWatch, UpstreamResponse
from router.config.model import GatewayConfig
from router.core.endpoints import EndpointPool, EndpointSnapshot
from router.core.errors import UpstreamError, UpstreamTimeoutError
from router.index.response_store import Probe, ResponseRoutes
from router.protocol.auth import TenantHeaders
from router.protocol.headers import request_id_of, response_headers
from router.upstream.client import UPSTREAM_ERRORS, UpstreamClient, UpstreamReply

Candidates = Callable[[str], list[EndpointSnapshot]]


def make_probe(
    client: UpstreamClient, headers: Callable[[str], Mapping[str, str]], timeout: float
) -> Probe:
    """``GET /v1/responses/{id}`` on one endpoint: True when it holds the response."""

    async def probe(endpoint: EndpointSnapshot, response_id: str) -> bool:
        url = f"{endpoint.url}/v1/responses/{response_id}"
        reply = None
        try:
            async with asyncio.timeout(timeout):
                reply = await client.request("GET", url, list(headers(endpoint.id).items()))
                return reply.status == 200
        except UPSTREAM_ERRORS:
            return False
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
        proxy = self._proxy
        headers: Mapping[str, str] = request.headers
        tenant = None
        if proxy.auth is not None:
            tenant = proxy.auth.authenticate(headers)
            headers = TenantHeaders(headers, tenant)
        body = await proxy.read_body(request) if request.method == "POST" else b""
        healthy = _healthy(self._pool, self._candidates)
        endpoint_id = await self._routes.resolve(response_id, self._pool, healthy)
        endpoint = next(c for c in healthy if c.id == endpoint_id)
        url = f"{endpoint.url}/v1/responses/{response_id}{suffix}"
        if request.url.query:
            url += "?" + request.url.query
        request_id = request_id_of(request.headers)
        upstream_headers = proxy.upstream_headers(request, request_id, tenant, endpoint_id)
        lease = self._pool.lease(endpoint_id)  # still in the pool: no await since resolve
        try:
            reply, first = await self._send(request.method, url, upstream_headers, body)
        except BaseException:
            lease.release()
            raise
        if request.method == "DELETE" and reply.status == 200:
            self._routes.forget(response_id)
        watch = DisconnectWatch(request.receive, request.scope)
        watch.start()
        return UpstreamResponse(
            reply,
            first,
            response_headers(reply.raw_headers, endpoint_id, request_id),
            lease=lease,
            watch=watch,
            idle_timeout=self._config.proxy.idle_timeout_seconds,
            deadlines=self._proxy.deadlines,
            on_finish=lambda outcome: None,
        )

    async def _send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[UpstreamReply, bytes]:
        try:
            attempt = await self._proxy.open_upstream(method, url, headers, body)
        except TimeoutError:
            raise UpstreamTimeoutError("the endpoint holding the response did not answer") from None
        except UPSTREAM_ERRORS as exc:
            kind = type(exc).__name__
            raise UpstreamError(
                f"the endpoint holding the response is unreachable ({kind})"
            ) from None
        return attempt.reply, attempt.first_chunk
