"""The request path: parse, route, forward, relay.

Attempts go to the ranked endpoints in order: a connect error, a timeout or a 5xx before the
first byte moves on to the next (bounded); a 4xx is the client's and is passed through as is.
Once a byte has been relayed the answer is committed to that endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from flow_control.request import Ticket
from router.config import GatewayConfig
from router.endpoints import EndpointSnapshot, Lease
from router.errors import PayloadTooLargeError, UpstreamError, UpstreamTimeoutError
from router.metrics import GatewayMetrics
from router.parsing import Api, ParsedRequest, parse_request
from router.routing import Router
from router.scheduling import RoutingRequest
from router.streaming import DisconnectWatch, UpstreamResponse
from router.upstream import UPSTREAM_ERRORS, UpstreamClient, UpstreamReply

log = logging.getLogger("prefixgate.proxy")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
REQUEST_ID_HEADER = "x-request-id"

# Headers a client may never set for the upstream: hop-by-hop ones, and the gateway's own
# routing headers (a client-chosen destination or prefiller would be an SSRF hole).
_DROP_REQUEST_HEADERS = frozenset(
    h.encode()
    for h in (
        "host", "content-length", "connection", "keep-alive", "proxy-authenticate",
        "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "expect", DESTINATION_HEADER, "x-gateway-destination-endpoint-subset",
        "x-prefiller-host-port", "x-gateway-request-dropped-reason", REQUEST_ID_HEADER,
    )
)
_DROP_RESPONSE_HEADERS = frozenset(
    h.encode()
    for h in (
        "connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "server",
        "date", DESTINATION_HEADER, REQUEST_ID_HEADER,
    )
)


@dataclass(slots=True)
class Attempt:
    reply: UpstreamReply
    first_chunk: bytes


class Proxy:
    def __init__(
        self,
        config: GatewayConfig,
        router: Router,
        metrics: GatewayMetrics,
    ) -> None:
        self._config = config
        self._router = router
        self._metrics = metrics
        self.client: UpstreamClient | None = None

    async def read_body(self, request: Request) -> bytes:
        limit = self._config.server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise asyncio.CancelledError from None
        return b"".join(chunks)

    async def handle(self, request: Request, api: Api) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        body = await self.read_body(request)
        parsed = parse_request(api, body)
        routing = self._router.routing_request(parsed, request.headers, request_id)
        # Watch from here on: a client leaving while queued or waiting for the first byte
        # must leave its queue or cancel the upstream request at once.
        watch = DisconnectWatch(request.receive)
        watch.start()
        ticket: Ticket | None = None
        handed_over = False
        try:
            ticket = await self._router.admit(routing, request.headers, len(body))
            ranked = await self._router.rank(routing)
            response = await self._forward(parsed, routing, ranked, request, watch, ticket)
            handed_over = True
            return response
        except asyncio.CancelledError:
            if not watch.absorb_cancel():
                raise
            self._metrics.client_disconnects.inc()
            self._metrics.requests.labels("none", "499", api).inc()
            return Response(status_code=499)
        finally:
            if not handed_over:
                watch.stop()
                if ticket is not None:
                    ticket.release()

    def _upstream_headers(self, request: Request, request_id: str) -> list[tuple[str, str]]:
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _DROP_REQUEST_HEADERS
        ]
        headers.append(("x-request-id", request_id))
        return headers

    async def _forward(
        self,
        parsed: ParsedRequest,
        routing: RoutingRequest,
        ranked: list[EndpointSnapshot],
        request: Request,
        watch: DisconnectWatch,
        ticket: Ticket,
    ) -> Response:
        assert self.client is not None, "the lifespan owns the client"
        proxy_cfg = self._config.proxy
        headers = self._upstream_headers(request, routing.request_id)
        path = "/v1/chat/completions" if parsed.api == "chat" else "/v1/completions"
        last_error: BaseException | None = None
        attempts = ranked[: proxy_cfg.max_attempts]
        for n, endpoint in enumerate(attempts):
            if n:
                self._metrics.retries.inc()
            lease = self._router.lease(routing, endpoint.id)
            if n == 0:
                self._router.picked(routing, endpoint.id)
            try:
                attempt = await self._attempt(endpoint, path, headers, parsed.body)
            except UPSTREAM_ERRORS as exc:
                lease.release()
                kind = "timeout" if isinstance(exc, TimeoutError) else "transport"
                self._metrics.upstream_failures.labels(endpoint.id, kind).inc()
                log.warning("request %s: %s on %s: %r", routing.request_id, kind, endpoint.id, exc)
                last_error = exc
                continue
            except BaseException:
                lease.release()
                raise
            if attempt.reply.status >= 500 and n + 1 < len(attempts):
                lease.release()
                self._metrics.upstream_failures.labels(endpoint.id, "5xx").inc()
                attempt.reply.close()
                continue
            if n:
                self._router.picked(routing, endpoint.id)
            lease.first_byte()
            return self._relay(attempt, endpoint, lease, watch, routing, parsed.api, ticket)
        if isinstance(last_error, TimeoutError):
            raise UpstreamTimeoutError("no endpoint answered within the first-byte timeout")
        raise UpstreamError(f"no endpoint could be reached ({type(last_error).__name__})")

    async def _attempt(
        self, endpoint: EndpointSnapshot, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> Attempt:
        assert self.client is not None
        reply: UpstreamReply | None = None
        try:
            async with asyncio.timeout(self._config.proxy.first_byte_timeout_seconds):
                reply = await self.client.post(endpoint.url + path, headers, body)
                first = await reply.next_chunk()
        except BaseException:
            if reply is not None:
                reply.close()
            raise
        return Attempt(reply, first)

    def _relay(
        self,
        attempt: Attempt,
        endpoint: EndpointSnapshot,
        lease: Lease,
        watch: DisconnectWatch,
        routing: RoutingRequest,
        api: str,
        ticket: Ticket,
    ) -> Response:
        upstream = attempt.reply
        headers = _response_headers(upstream.raw_headers, endpoint.id, routing.request_id)
        status = str(upstream.status)
        requests = self._metrics.requests
        disconnects = self._metrics.client_disconnects
        stream_errors = self._metrics.stream_errors

        def finish(outcome: str) -> None:
            ticket.release()
            requests.labels(endpoint.id, status, api).inc()
            if outcome == "client_disconnect":
                disconnects.inc()
            elif outcome == "stream_error":
                stream_errors.labels(endpoint.id).inc()

        return UpstreamResponse(
            upstream,
            attempt.first_chunk,
            headers,
            lease=lease,
            watch=watch,
            idle_timeout=self._config.proxy.idle_timeout_seconds,
            on_finish=finish,
        )


def _response_headers(
    raw: Iterable[tuple[bytes, bytes]], endpoint_id: str, request_id: str
) -> list[tuple[bytes, bytes]]:
    headers = [(k.lower(), v) for k, v in raw if k.lower() not in _DROP_RESPONSE_HEADERS]
    headers.append((DESTINATION_HEADER.encode(), endpoint_id.encode()))
    headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
    return headers
