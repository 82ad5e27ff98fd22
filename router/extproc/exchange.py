"""One HTTP request as Envoy shows it to the endpoint picker, over its ext_proc stream.

Request phase: headers, then the body (FULL_DUPLEX_STREAMED: chunks that Envoy forwards only
once streamed back; BUFFERED: one message, answered after the headers were let through, with
end_of_stream false when trailers follow). The pick is sent once the body is complete.
Response phase: the lease (in-flight count) and the flow-control ticket are released at the
response's end of stream or when the stream closes, whichever comes first, exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from flow_control.request import Ticket
from router.api.request_body import join_body
from router.app import Gateway
from router.config.model import ExtProcConfig
from router.core.endpoints import EndpointSnapshot
from router.core.errors import GatewayError, NoEndpointsError, PayloadTooLargeError
from router.core.framework import RoutingRequest
from router.core.lease import Lease
from router.extproc.answer import AnswerWatch
from router.extproc.messages import (
    continue_body,
    continue_request_headers,
    continue_response_headers,
    header_map,
    immediate,
    in_subset,
    passed_on,
    routed_body,
    routed_headers,
    served_endpoint,
    streamed_body,
    streamed_chunks,
    subset_hint,
    trailers,
)
from router.extproc.metrics import ExtProcMetrics
from router.extproc.paths import api_for, stored_response_id
from router.protocol.headers import DESTINATION_HEADER, request_id_of
from router.protocol.parsing import Api, ParsedRequest
from router.scheduling.disagg import PREFILLER_HEADER, wants_prompt_logprobs

log = logging.getLogger("prefixgate.extproc")

_MODE = processing_mode_pb2.ProcessingMode
Candidates = Callable[[str], list[EndpointSnapshot]]
_ROUTABLE_MODES = (_MODE.FULL_DUPLEX_STREAMED, _MODE.BUFFERED)


class Exchange:
    """One HTTP request as Envoy shows it: route on the request, release on the response."""

    def __init__(
        self,
        gateway: Gateway,
        settings: ExtProcConfig,
        candidates: Candidates,
        metrics: ExtProcMetrics,
    ) -> None:
        self._gw = gateway
        self._settings = settings
        self._candidates = candidates
        self._metrics = metrics
        duplex = settings.default_body_mode == "FULL_DUPLEX_STREAMED"
        self._request_mode = _MODE.FULL_DUPLEX_STREAMED if duplex else _MODE.BUFFERED
        self._response_mode = self._request_mode
        self._announced = False  # whether Envoy said which body modes it uses
        self._headers: dict[str, str] = {}
        # The request body's pieces, joined once it is whole (off the loop when large).
        self._parts: list[bytes] = []
        self._size = 0
        self._subset: frozenset[str] | None = None
        self._destination: str | None = None
        # Where the data plane says the request went (a fallback of the list, say).
        self._served: str | None = None
        self._api = "none"
        self._status = "none"
        self._ticket: Ticket | None = None
        self._lease: Lease | None = None
        self._prefill_lease: Lease | None = None
        self._extra: dict[str, str] = {}
        # The routed request, and what reads its answer (router/extproc/answer.py).
        self._routing: RoutingRequest | None = None
        self._answer = AnswerWatch("none", None)
        self._closed = False
        self.done = False

    @property
    def _duplex(self) -> bool:
        return bool(self._request_mode == _MODE.FULL_DUPLEX_STREAMED)

    async def handle(self, message: Any) -> list[Any]:
        """The answers to one message from Envoy (none while a duplex body is still arriving)."""
        if message.HasField("protocol_config"):
            self._request_mode = message.protocol_config.request_body_mode
            self._response_mode = message.protocol_config.response_body_mode
            self._announced = True
        if message.HasField("metadata_context"):
            hint = subset_hint(message.metadata_context)
            if hint is not None:
                self._subset = hint
            served = served_endpoint(message.metadata_context)
            if served is not None:
                self._served = served
        kind = message.WhichOneof("request")
        if kind is None:
            return []
        part = getattr(message, kind)
        try:
            return await self._dispatch(kind, part)
        except Exception as exc:
            if kind.startswith("response_"):
                return self._pass_on(kind, part)
            if isinstance(exc, GatewayError):
                return self._reject(exc)
            log.exception("ext_proc: failed on %s", kind)  # costs one request, not the picker
            return self._reject(GatewayError("the endpoint picker failed on this request"))

    def _pass_on(self, kind: str, part: Any) -> list[Any]:
        """The answer is the replica's: a failure of the picker's own reading of it (counting,
        learning) must not cut it. The message goes on unchanged, the reading stops, and the
        request is still released at the answer's end."""
        log.exception("ext_proc: failed on %s; the answer goes on unread", kind)
        self._answer = AnswerWatch(self._api, None)
        if kind == "response_trailers" or part.end_of_stream:
            self.close()
        duplex = self._response_mode == _MODE.FULL_DUPLEX_STREAMED
        return [passed_on(kind, part, duplex)]

    async def _dispatch(self, kind: str, part: Any) -> list[Any]:
        if kind == "request_headers":
            return await self._request_headers(part)
        if kind == "request_body":
            return await self._request_body(part)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(part)
        if kind == "response_body":
            return self._response_body(part)
        if kind == "response_trailers":
            self._answer.finish()
            self.close()
            return [trailers("response")]
        return []

    async def _request_headers(self, part: Any) -> list[Any]:
        self._headers = header_map(part)
        if part.end_of_stream or self._request_mode == _MODE.NONE:
            stored = stored_response_id(self._headers.get(":path", ""))
            if stored is not None:
                return [routed_headers(await self._pick_stored(stored))]
            return [routed_headers(self._pick_any())]
        if self._request_mode not in _ROUTABLE_MODES:
            # Envoy has chosen the upstream before such a body arrives: say so loudly.
            name = _MODE.BodySendMode.Name(self._request_mode)
            raise GatewayError(
                f"ext_proc request_body_mode {name} cannot carry a routing decision; "
                "configure FULL_DUPLEX_STREAMED or BUFFERED"
            )
        return [] if self._duplex else [continue_request_headers()]

    async def _request_body(self, part: Any) -> list[Any]:
        if self._destination is not None:  # late chunks: pass them through
            if self._duplex:
                return [streamed_body(part.body, part.end_of_stream, "request")]
            return [continue_body("request")]
        self._parts.append(part.body)
        self._size += len(part.body)
        limit = self._gw.config.server.max_body_bytes
        if self._size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        if part.end_of_stream or part.end_of_stream_without_message:
            return await self._route(end_of_stream=True)
        if not self._duplex:  # BUFFERED sends the whole body at once, open when trailers follow
            return await self._route(end_of_stream=False)
        return []

    async def _request_trailers(self) -> list[Any]:
        if self._destination is not None:
            return [trailers("request")]
        if self._duplex:  # the body streamed in without an end: it ends here
            return [*await self._route(end_of_stream=False), trailers("request")]
        # Trailers with no body before them: a trailers answer cannot set request headers.
        raise GatewayError("a request without a body that ends on trailers cannot be routed")

    async def _route(self, end_of_stream: bool) -> list[Any]:
        path = self._headers.get(":path", "")
        api = api_for(path)
        body = await join_body(self._parts, self._size)
        self._parts, self._size = [], 0
        stored = stored_response_id(path)
        forwarded = body
        if api is not None:
            destination, forwarded = await self._pick(api, body)
        elif stored is not None:
            destination = await self._pick_stored(stored)
        else:
            destination = self._pick_any()
        rewritten = forwarded is not body
        if not self._duplex:
            return [routed_body(destination, self._extra, forwarded if rewritten else None)]
        chunks = streamed_chunks(forwarded, self._settings.body_chunk_bytes, end_of_stream)
        return [routed_headers(destination, self._extra, rewritten), *chunks]

    def _allowed(self) -> Callable[[EndpointSnapshot], bool] | None:
        """Envoy's subset hint, as a filter on the candidates (None: every endpoint)."""
        subset = self._subset
        if subset is None:
            return None
        return lambda candidate: in_subset(candidate.id, subset)

    async def _pick(self, api: Api, body: bytes) -> tuple[str, bytes]:
        """The full routing path of the HTTP gateway: parse (a large body off the loop), admit,
        rank, lease, learn. Returns the destination and the body to forward (the client's,
        unless parsing dropped fields only the gateway sets)."""
        # The picker only names a prefiller (the decode endpoint's sidecar sends the prefill
        # request): with disaggregation it reads the decoded body for prompt logprobs alone.
        disagg = self._gw.proxy.disagg is not None
        prepared = await self._gw.preparer.prepare(api, body, decodes_payload=disagg)
        self._api = api
        router = self._gw.router
        request_id = request_id_of(self._headers)
        routing = router.routing_request(prepared.parsed, self._headers, request_id, prepared)
        self._ticket = await router.admit(routing, self._headers, len(body))
        ranked = await router.rank(routing, self._allowed())
        # Before the decode lease, which must know whether its endpoint pulls the KV.
        if await self._choose_prefiller(prepared.parsed, routing, ranked[0]):
            # Ranked before the prefill pool was: the lease reads the queues as they are now.
            ranked = [n for c in ranked if (n := router.current(routing.model, c.id)) is not None]
            if not ranked:
                raise NoEndpointsError("no decode endpoint left to route to")
        self._lease = router.lease(routing, ranked[0])
        router.picked(routing, ranked[0].id)
        self._routing = routing
        self._count_tokens(prepared.parsed, routing, ranked[0])
        destination = ",".join(e.id for e in ranked[: 1 + self._settings.fallback_endpoints])
        return self._routed(destination, "routed"), prepared.parsed.body

    def _count_tokens(
        self, parsed: ParsedRequest, routing: RoutingRequest, endpoint: EndpointSnapshot
    ) -> None:
        """A replica counts the prompt where the picker will read no usage (no response body,
        or none in it: router/index/token_counts.py); only a body decoded already."""
        if parsed.decoded is None:
            return
        self._gw.token_counts.consider(
            parsed.api, parsed.stream, parsed.decoded, routing.model, routing.prompt_bytes,
            endpoint, answer_seen=self._response_mode != _MODE.NONE,
        )

    async def _choose_prefiller(
        self, parsed: ParsedRequest, routing: RoutingRequest, decode: EndpointSnapshot
    ) -> bool:
        """With disaggregation, Envoy reaches one destination: the decode endpoint, whose
        routing sidecar runs the prefill step on the endpoint named in x-prefiller-host-port
        (llm-d's sidecar mode, whatever ``disaggregation.mode`` says for the HTTP gateway).
        The HTTP gateway's rules (router/scheduling/disagg.py): no split for prompt logprobs,
        decode alone when the prefiller left the pool, the decode marked ``remote_prefill``.
        Whether the prefill pool was ranked (after the decode pool, with an await between)."""
        disagg = self._gw.proxy.disagg
        if disagg is None:
            return False
        if wants_prompt_logprobs(parsed.api, parsed.payload):
            disagg.metrics.decisions.labels("decode_only").inc()
            return False
        choice = await disagg.choose_prefiller(routing, decode)
        if choice is None:
            return False
        prefill_routing, prefill = choice
        router = self._gw.router
        try:
            self._prefill_lease = router.lease(prefill_routing, prefill)
        except KeyError:  # it left the pool while the prefill pool was ranked: decode alone
            return True
        router.picked(prefill_routing, prefill.id)
        self._extra = {PREFILLER_HEADER: prefill.id}
        routing.remote_prefill = True
        return True

    def _eligible_any(self) -> list[EndpointSnapshot]:
        found = {c.id: c for m in self._gw.pool.models() for c in self._candidates(m)}
        eligible = [
            c for c in found.values() if self._subset is None or in_subset(c.id, self._subset)
        ]
        if not eligible:
            raise NoEndpointsError("no healthy endpoint to route to")
        return eligible

    async def _pick_stored(self, response_id: str) -> str:
        """A stored response lives on one endpoint: that one, or the 4xx saying why not."""
        routes = self._gw.router.responses
        if routes is None:
            return self._pick_any()
        eligible = self._eligible_any()
        endpoint = await routes.resolve(response_id, self._gw.pool, eligible)
        self._lease = self._gw.pool.lease(endpoint)
        return self._routed(endpoint, "routed-stored-response")

    def _pick_any(self) -> str:
        """No body to read (GET, or a path the gateway does not parse): the least loaded."""
        pool = self._gw.pool
        eligible = self._eligible_any()
        ranked = sorted(eligible, key=lambda c: (c.in_flight, c.id))
        self._lease = pool.lease(ranked[0].id)
        destination = ",".join(e.id for e in ranked[: 1 + self._settings.fallback_endpoints])
        return self._routed(destination, "routed-without-body")

    def _routed(self, destination: str, outcome: str) -> str:
        self._destination = destination
        self._metrics.decisions.labels(outcome).inc()
        return destination

    def _reject(self, error: GatewayError) -> list[Any]:
        if error.dropped_reason is not None:
            outcome = "rejected"
        else:
            outcome = "invalid" if error.status_code < 500 else "error"
        self._metrics.decisions.labels(outcome).inc()
        self._status = str(error.status_code)
        self.close()
        self.done = True
        messages = api_for(self._headers.get(":path", "")) == "messages"
        return [immediate(error, anthropic_shape=messages)]

    def _response_headers(self, part: Any) -> list[Any]:
        self._status = header_map(part).get(":status", "none")
        self._follow_served()
        destinations = (self._destination or "").split(",")
        self._answer = AnswerWatch(self._api, self._lease)
        self._answer.headers(
            self._gw, self._routing, self._status, part.end_of_stream,
            self._response_mode if self._announced else None, destinations,
        )
        if part.end_of_stream:
            self.close()
        picked = destinations[0]
        return [continue_response_headers({DESTINATION_HEADER: picked} if picked else {})]

    def _follow_served(self) -> None:
        """The data plane says which endpoint served the request: read its answer as that
        endpoint's (usage, where a Responses answer is stored) and, when it is not the pick (a
        fallback of the list, or one the gateway's own fallback policy chose when the pick was
        gone), count the request there, learning from its first byte as from the pick's."""
        served, destination = self._served, self._destination
        if served is None or destination is None:
            return
        picked = destination.split(",")[0]
        if served != picked and self._gw.pool.get(served) is None:
            log.warning("ext_proc: served by %s, not an endpoint of the pool", served)
            return
        self._destination = served
        if served == picked or self._lease is None:
            return
        self._lease.release()
        routing, router = self._routing, self._gw.router
        # No routing: routed without reading a body, nothing to learn from.
        snapshot = router.current(routing.model, served) if routing is not None else None
        if routing is not None and snapshot is not None:
            self._lease = router.lease(routing, snapshot)
        else:  # counted, not learned from
            self._lease = self._gw.pool.lease(served)

    def _response_body(self, part: Any) -> list[Any]:
        self._answer.body(part.body)
        if part.end_of_stream or part.end_of_stream_without_message:
            self._answer.finish()
            self.close()
        if self._response_mode == _MODE.FULL_DUPLEX_STREAMED:
            return [streamed_body(part.body, part.end_of_stream, "response")]
        return [continue_body("response")]

    def close(self) -> None:
        """The request is over (response end, stream closed, or rejected): release once."""
        if self._closed:
            return
        self._closed = True
        if self._lease is not None:
            self._lease.release()
        if self._prefill_lease is not None:
            self._prefill_lease.release()
        if self._ticket is not None:
            self._ticket.release()
        if self._destination is not None:
            endpoint = self._destination.split(",")[0]
            self._gw.metrics.count_request(endpoint, self._status, self._api)
        elif self._status != "none":  # refused (shed, no endpoint, 4xx): as the gateway does
            self._gw.metrics.count_request("none", self._status, self._api)
