"""Requests the gateway forwards to one endpoint it has chosen, outside the inference path: no
flow control, no prefix index, no retry on another endpoint (the stored responses of the
Responses API, Anthropic's token counting). Counted in the endpoint's in-flight requests while
they last, and relayed as they come.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from router.api.proxy import Proxy
from router.api.streaming import DisconnectWatch, ErrorEvent, UpstreamResponse, sse_error_event
from router.core.errors import UpstreamError, UpstreamTimeoutError
from router.core.pool import EndpointPool
from router.protocol.headers import response_headers
from router.upstream.client import UPSTREAM_ERRORS


async def pass_through(
    proxy: Proxy,
    pool: EndpointPool,
    request: Request,
    endpoint_id: str,
    url: str,
    upstream_headers: list[tuple[str, str]],
    body: bytes,
    request_id: str,
    what: str,
    idle_timeout: float,
    *,
    error_event: ErrorEvent = sse_error_event,
) -> Response:
    """Send the request to ``url`` on ``endpoint_id`` (still in the pool: the caller has not
    awaited since it chose it) and relay the answer; ``what`` names the endpoint in errors,
    ``error_event`` renders a failure mid-stream (in the API's own event shape)."""
    if request.url.query:
        url += "?" + request.url.query
    # Watched from before it is sent, as on the inference routes: a client that leaves while
    # the endpoint has not answered yet cancels the request upstream.
    watch = DisconnectWatch(request.receive, request.scope)
    watch.start()
    if watch.disconnected:
        return Response(status_code=499)
    lease = pool.lease(endpoint_id)
    try:
        attempt = await proxy.open_upstream(request.method, url, upstream_headers, body)
    except BaseException as exc:
        lease.release()
        watch.stop()
        if isinstance(exc, asyncio.CancelledError) and watch.absorb_cancel():
            return Response(status_code=499)
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeoutError(f"{what} did not answer") from None
        if isinstance(exc, UPSTREAM_ERRORS):
            raise UpstreamError(f"{what} is unreachable ({type(exc).__name__})") from None
        raise
    reply = attempt.reply
    return UpstreamResponse(
        reply,
        attempt.first_chunk,
        response_headers(reply.raw_headers, endpoint_id, request_id),
        lease=lease,
        watch=watch,
        idle_timeout=idle_timeout,
        deadlines=proxy.deadlines,
        on_finish=lambda outcome: None,
        error_event=error_event,
    )
