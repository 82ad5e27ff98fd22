"""The request path: authenticate, parse, route, forward, relay, log.

Attempts go to the ranked endpoints in order (router/api/failover.py). Once a byte has been
relayed the answer is committed to that endpoint.

The gateway only ever connects to endpoints of its pool: the URL of an attempt comes from the
pool's snapshot, and every header a client could use to steer a request is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response

from flow_control.request import Ticket
from router.api.asgi import ErrorRenderer, error_response
from router.api.attempt import Attempt, open_attempt
from router.api.deadlines import Deadlines
from router.api.failover import Answered, Failover
from router.api.logs import AccessLog
from router.api.prediction import PredictionTracker
from router.api.request_body import BodyPreparer, read_body
from router.api.streaming import (
    DisconnectWatch,
    ErrorEvent,
    FirstToken,
    UpstreamResponse,
    sse_error_event,
    tell_first_byte,
)
from router.api.usage_tap import answer_taps
from router.config.model import GatewayConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import ClientCancelledError, GatewayError, ShuttingDownError
from router.core.framework import RoutingRequest
from router.core.lease import Lease
from router.index.sizing import IndexSizer
from router.index.token_counts import TokenCounts
from router.pool.metrics import GatewayMetrics
from router.protocol import anthropic, responses_api
from router.protocol.auth import Authenticator, TenantHeaders, UpstreamKeys
from router.protocol.exchange import Exchange
from router.protocol.headers import (
    REQUEST_ID_HEADER,
    ForwardedHeaders,
    RequestHeaders,
    RequestIds,
    request_id_of,
    response_headers,
)
from router.protocol.parsing import UPSTREAM_PATHS, Api, ParsedRequest
from router.scheduling.disagg import SPLIT_APIS, Disaggregator
from router.scheduling.routing import Router
from router.upstream.client import UpstreamClient, UpstreamReply

# Mid-stream errors in each API's own event shape (chat and completions: OpenAI's data event).
_ERROR_EVENTS: dict[str, ErrorEvent] = {
    "messages": anthropic.stream_error_event,
    "responses": responses_api.stream_error_event,
}


class Proxy:
    """Built complete by the composition root (router/app/): it owns none of its
    collaborators' lifetimes; the upstream client is opened and closed by the lifespan."""

    def __init__(
        self,
        config: GatewayConfig,
        router: Router,
        metrics: GatewayMetrics,
        client: UpstreamClient,
        *,
        preparer: BodyPreparer,
        upstream_keys: UpstreamKeys,
        auth: Authenticator | None = None,
        prediction: PredictionTracker | None = None,
        sizer: IndexSizer | None = None,
        token_counts: TokenCounts | None = None,
        disagg: Disaggregator | None = None,
    ) -> None:
        self._config = config
        self._router = router
        self._metrics = metrics
        self.client = client
        # Prefill/decode disaggregation, when it is enabled.
        self.disagg = disagg
        self.prediction = prediction
        # Where each body is parsed (the ext_proc picker's too): large ones off the loop.
        self.preparer = preparer
        # Bytes per token from each answer's usage (or a replica's count where it has none).
        self.sizer, self.token_counts = sizer, token_counts
        self.auth = auth
        self.upstream_keys = upstream_keys
        self._headers = ForwardedHeaders(
            self.upstream_keys, self.auth is not None, config.auth.forward_client_key
        )
        server = config.server
        self._access = AccessLog(server.access_log, server.access_log_sample_rate)
        self._ids = RequestIds()
        # The timeouts of every request's waits, on one coarse tick (router/api/deadlines.py).
        self.deadlines = Deadlines()
        # Set on SIGTERM: /ready answers 503, and requests cut by the drain deadline end cleanly.
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = Gauge(
            "prefixgate_requests_in_flight",
            "Requests inside the gateway: queued, waiting for a first byte or streaming.",
            registry=metrics.registry,
        )
        self._in_flight.set_function(lambda: self.active)
        self.failover = Failover(config.proxy, router, metrics)

    async def read_body(self, request: Request, headers: Mapping[str, str] | None = None) -> bytes:
        server = self._config.server
        declared = (headers or request.headers).get("content-length")
        return await read_body(
            request.receive, declared, server.max_body_bytes, server.body_timeout_seconds,
            self.deadlines,
        )

    async def handle(
        self, request: Request, api: Api, render: ErrorRenderer = error_response
    ) -> Response:
        """The answer to ``request``; a refusal rendered by ``render`` (the API's error shape),
        with the request's id as every answer has."""
        headers = RequestHeaders(request.scope["headers"])
        ex = Exchange(api, request_id_of(headers, self._ids), time.perf_counter())
        self.active += 1
        self._idle.clear()
        try:
            response = await self._serve(request, headers, ex)
        except GatewayError as exc:
            ex.status, ex.outcome = exc.status_code, "rejected"
            if isinstance(exc, ClientCancelledError):
                ex.outcome = "client_disconnect"
                self._metrics.client_disconnects.inc()
            self._finish(ex)
            refusal = render(exc)
            refusal.headers[REQUEST_ID_HEADER] = ex.request_id
            return refusal
        except BaseException:
            ex.status, ex.outcome = 500, "crashed"
            self._finish(ex)
            raise
        if not isinstance(response, UpstreamResponse):
            self._finish(ex)
        return response

    async def _serve(
        self, request: Request, headers: Mapping[str, str], ex: Exchange
    ) -> Response:
        # Before the body: an unauthenticated client must not make the gateway buffer 32 MB.
        if self.auth is not None:
            ex.tenant = self.auth.authenticate(headers)
            headers = TenantHeaders(headers, ex.tenant)
        body = await self.read_body(request, headers)
        # Disaggregation reads the decoded body to build its prefill request.
        prepared = await self.preparer.prepare(
            ex.api, body, decodes_payload=self.disagg is not None
        )
        parsed = prepared.parsed
        ex.model, ex.stream = parsed.model, parsed.stream
        routing = self._router.routing_request(parsed, headers, ex.request_id, prepared)
        # Watch from here on: a client leaving while queued or waiting for the first byte
        # must leave its queue or cancel the upstream request at once.
        watch = DisconnectWatch(request.receive, request.scope)
        watch.start()
        if watch.disconnected:
            ex.status, ex.outcome = 499, "client_disconnect"
            self._metrics.client_disconnects.inc()
            return Response(status_code=499)
        ticket: Ticket | None = None
        handed_over = False
        try:
            ticket = await self._router.admit(routing, headers, len(body))
            ranked = await self._router.rank(routing)
            self._metrics.gateway_delay.observe(time.perf_counter() - ex.started)
            # The prefill step speaks chat and completions (router/scheduling/disagg.py).
            split = self.disagg is not None and parsed.api in SPLIT_APIS
            forward = self._disaggregated if split else self._forward
            response = await forward(parsed, routing, ranked, request, watch, ticket, ex)
            # A relay releases the ticket and stops the watch when it ends; an answer made
            # here (a prefill step's 4xx) is done now.
            handed_over = isinstance(response, UpstreamResponse)
            return response
        except asyncio.CancelledError:
            if watch.absorb_cancel():
                ex.status, ex.outcome = 499, "client_disconnect"
                self._metrics.client_disconnects.inc()
                return Response(status_code=499)
            task = asyncio.current_task()
            if not self.draining or task is None:
                raise
            # The drain deadline passed: answer instead of dropping the connection.
            task.uncancel()
            raise ShuttingDownError("the gateway is shutting down; retry") from None
        finally:
            if not handed_over:
                watch.stop()
                if ticket is not None:
                    ticket.release()

    def upstream_headers(
        self, request: Request, request_id: str, tenant: str | None, endpoint_id: str
    ) -> list[tuple[str, str]]:
        """What a request forwarded to ``endpoint_id`` carries (requests outside the proxy's
        own path, such as those naming a stored response)."""
        headers = self._headers.base(request.headers.raw, request_id, tenant)
        return self._headers.keyed(headers, endpoint_id)

    async def _forward(
        self,
        parsed: ParsedRequest,
        routing: RoutingRequest,
        ranked: list[EndpointSnapshot],
        request: Request,
        watch: DisconnectWatch,
        ticket: Ticket,
        ex: Exchange,
        extra_headers: Sequence[tuple[str, str]] = (),
        ranked_earlier: bool = False,
    ) -> Response:
        """``ranked_earlier``: ``ranked`` is from before an await (a prefill step)."""
        headers = self._headers.base(request.headers.raw, routing.request_id, ex.tenant)
        headers.extend(extra_headers)
        path = UPSTREAM_PATHS[parsed.api]
        # A Responses stream is answered before its first token: wait for that token.
        opening = responses_api.opening if parsed.api == "responses" and parsed.stream else None

        async def send(endpoint: EndpointSnapshot) -> Attempt:
            keyed = self._headers.keyed(headers, endpoint.id)
            return await self.open_upstream(
                "POST", endpoint.url + path, keyed, parsed.body, opening
            )

        answered = await self.failover.first_answer(routing, ranked, send, ex, ranked_earlier)
        return self._answered(answered, parsed, routing, watch, ticket, ex)

    async def _disaggregated(
        self,
        parsed: ParsedRequest,
        routing: RoutingRequest,
        ranked: list[EndpointSnapshot],
        request: Request,
        watch: DisconnectWatch,
        ticket: Ticket,
        ex: Exchange,
    ) -> Response:
        """The prefill step first when the decider asks for one (router/scheduling/disagg.py)."""
        assert self.disagg is not None
        client = self.client
        headers = self._headers.base(request.headers.raw, routing.request_id, ex.tenant)

        async def post(endpoint: EndpointSnapshot, path: str, body: bytes) -> UpstreamReply:
            keyed = self._headers.keyed(headers, endpoint.id)
            return await client.post(endpoint.url + path, keyed, body)

        step = await self.disagg.prepare(parsed, routing, ranked, post, self.failover.failed)
        if step.response is not None:  # a prefill 4xx is the client's
            ex.status, ex.endpoint = step.response.status_code, step.prefill_endpoint
            return step.response
        try:
            return await self._forward(
                step.parsed, routing, ranked, request, watch, ticket, ex, step.headers,
                ranked_earlier=step.ranked_earlier,
            )
        finally:
            step.release()

    def _note_pick(self, ex: Exchange, routing: RoutingRequest, endpoint_id: str) -> None:
        ex.endpoint = endpoint_id
        ex.ttfb = time.perf_counter() - ex.started
        self._metrics.first_byte.observe(ex.ttfb)
        if routing.block_hashes:
            hits = routing.prefix_hits.get(endpoint_id, 0)
            ex.prefix_match = hits / len(routing.block_hashes)

    async def open_upstream(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
        opening: Callable[[bytes], bool] | None = None,
    ) -> Attempt:
        """Send a request upstream and wait for its answer's first chunk (router/api/attempt.py)."""
        timeout = self._config.proxy.first_byte_timeout_seconds
        return await open_attempt(
            self.client, self.deadlines, timeout, method, url, headers, body, opening
        )

    def _answered(
        self, answered: Answered, parsed: ParsedRequest, routing: RoutingRequest,
        watch: DisconnectWatch, ticket: Ticket, ex: Exchange,
    ) -> Response:
        """The endpoint answered: its first byte (a Responses stream's opening events come
        before any token: then at the first chunk past them, streaming.FirstToken), a token
        count where the answer will have none (of a body decoded here), then the relay."""
        attempt, endpoint, lease = answered.attempt, answered.endpoint, answered.lease
        status, first, begun = attempt.reply.status, attempt.first_chunk, responses_api.TOKEN
        if status >= 400:
            # An error reply comes before any prefill: its time is no first token's (as the
            # picker's, router/extproc/answer.py), neither for the calibrator nor the limits.
            begun = responses_api.FAILED
        elif parsed.api == "responses" and parsed.stream and status == 200 and first:
            begun = responses_api.answer_begun(first)
        tell_first_byte(lease, begun, answered=status < 400)
        later = begun == responses_api.OPENING
        self._note_pick(ex, routing, endpoint.id)
        counts = self.token_counts
        if counts is not None and parsed.decoded is not None and status < 400:
            counts.consider(
                parsed.api, parsed.stream, parsed.decoded, routing.model, routing.prompt_bytes,
                endpoint,
            )
        return self._relay(attempt, endpoint, lease, watch, ticket, ex, routing, later)

    def _relay(
        self,
        attempt: Attempt,
        endpoint: EndpointSnapshot,
        lease: Lease,
        watch: DisconnectWatch,
        ticket: Ticket,
        ex: Exchange,
        routing: RoutingRequest,
        first_token_later: bool = False,
    ) -> Response:
        upstream = attempt.reply
        ex.status = upstream.status
        explained = routing.explanation if routing.explain_to_client else None
        headers = response_headers(upstream.raw_headers, endpoint.id, ex.request_id, explained)
        observe, usage = answer_taps(
            upstream.status, endpoint.id, routing, self.prediction,
            self.sizer.observe if self.sizer is not None else None,
            self._router.responses if ex.api == "responses" else None,
        )
        if first_token_later:
            observe = FirstToken(lease, responses_api.answer_begun, observe)

        def finish(outcome: str) -> None:
            ticket.release()
            ex.outcome = outcome
            if usage is not None and outcome == "ok":
                usage.finish()
            if outcome == "client_disconnect":
                self._metrics.client_disconnects.inc()
            elif outcome == "stream_error":
                self._metrics.stream_errors.labels(endpoint.id).inc()
                self.failover.failed(lease, endpoint.id, "stream")
            self._finish(ex)

        return UpstreamResponse(
            upstream,
            attempt.first_chunk,
            headers,
            lease=lease,
            watch=watch,
            idle_timeout=self._config.proxy.idle_timeout_seconds,
            deadlines=self.deadlines,
            on_finish=finish,
            draining=lambda: self.draining,
            error_event=_ERROR_EVENTS.get(ex.api, sse_error_event),
            observe=observe,
        )

    def _finish(self, ex: Exchange) -> None:
        self.active -= 1
        if not self.active:
            self._idle.set()
        self._metrics.count_request(ex.endpoint or "none", ex.status, ex.api)
        access = self._access
        if access.active and access.sampled(ex.status >= 400 or ex.outcome != "ok"):
            access.record(ex, time.perf_counter())

    async def wait_idle(self, seconds: float) -> bool:
        """Wait (bounded) until no request is inside the gateway; True if none is."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._idle.wait()
        return self.active == 0
