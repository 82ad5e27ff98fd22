"""Envoy ext_proc messages: reading what Envoy sends, building what the endpoint picker answers.

The Gateway API Inference Extension's protocol: the pick goes back both as the request header
``x-gateway-destination-endpoint`` and as dynamic metadata ``envoy.lb`` ->
``x-gateway-destination-endpoint`` (``ip:port`` or an ordered ``ip:port,ip:port`` list);
the subset hint comes in filter metadata ``envoy.lb.subset_hint``; a request the picker will
not route is answered by Envoy with an ImmediateResponse on the picker's behalf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.core.errors import GatewayError
from router.protocol import anthropic
from router.protocol.headers import DESTINATION_HEADER, ROUTING_HEADERS

LB_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Headers only the picker may set (besides the destination, which it overwrites): a client's
# own would choose where the request, or the sidecar's prefill and KV pulls, go (SSRF).
CLIENT_FORBIDDEN_HEADERS = ROUTING_HEADERS

Phase = Literal["request", "response"]
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message as a dict of lower-case names (repeated names joined)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def subset_hint(metadata: Any) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request, or None when it sets no hint."""
    if SUBSET_HINT_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_HINT_NAMESPACE].fields
    if SUBSET_HINT_KEY not in fields:
        return None
    value = fields[SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        # An entry may itself be a comma-separated list (the reference picker splits them too).
        items: Iterable[str] = (
            name for v in value.list_value.values for name in v.string_value.split(",")
        )
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        return frozenset()
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(metadata: Any) -> str | None:
    """The endpoint the data plane says served the request (``envoy.lb`` namespace,
    ``x-gateway-destination-endpoint-served``: it may be a fallback, not the pick), or None."""
    if LB_NAMESPACE not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[LB_NAMESPACE].fields.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value.strip() or None


def in_subset(endpoint_id: str, subset: frozenset[str]) -> bool:
    """``ip:port`` matches itself, or the bare ``ip`` (gateways send either)."""
    if endpoint_id in subset:
        return True
    host = endpoint_id.rsplit(":", 1)[0]
    return host in subset or host.strip("[]") in subset


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("utf-8")),
        append_action=_OVERWRITE,
    )


def header_mutation(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> Any:
    return pb.HeaderMutation(
        set_headers=[_header(k, v) for k, v in (set_headers or {}).items()],
        remove_headers=list(remove),
    )


def lb_metadata(destination: str) -> Any:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    return metadata


def _routed(
    destination: str, extra: Mapping[str, str], remove: tuple[str, ...] = ()
) -> Any:
    return pb.CommonResponse(
        header_mutation=header_mutation(
            {DESTINATION_HEADER: destination, **extra}, (*CLIENT_FORBIDDEN_HEADERS, *remove)
        ),
        clear_route_cache=True,
    )


def routed_headers(
    destination: str, extra: Mapping[str, str] | None = None, rewritten: bool = False
) -> Any:
    """FULL_DUPLEX_STREAMED: the (held back) answer to the request headers carries the pick
    (and ``extra`` headers for the upstream, such as the prefiller for a P/D sidecar);
    ``rewritten``: the body streamed back is not the client's, so its length header goes."""
    remove = ("content-length",) if rewritten else ()
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=_routed(destination, extra or {}, remove)),
        dynamic_metadata=lb_metadata(destination),
    )


def routed_body(
    destination: str, extra: Mapping[str, str] | None = None, rewritten: bytes | None = None
) -> Any:
    """BUFFERED: the answer to the buffered body carries the pick (headers are still held),
    and the body to send in the client's place when parsing ``rewritten`` it."""
    if rewritten is None:
        common = _routed(destination, extra or {})
    else:
        length = {"content-length": str(len(rewritten))}
        common = _routed(destination, {**(extra or {}), **length})
        common.body_mutation.body = rewritten
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common),
        dynamic_metadata=lb_metadata(destination),
    )


def continue_request_headers() -> Any:
    # Strip the client's routing headers now: the body answer can only overwrite the one.
    remove = (DESTINATION_HEADER, *CLIENT_FORBIDDEN_HEADERS)
    common = pb.CommonResponse(header_mutation=header_mutation(remove=remove))
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))


def continue_body(phase: Phase) -> Any:
    if phase == "request":
        return pb.ProcessingResponse(request_body=pb.BodyResponse())
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def continue_response_headers(set_headers: Mapping[str, str]) -> Any:
    common = pb.CommonResponse(header_mutation=header_mutation(set_headers))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def trailers(phase: Phase) -> Any:
    if phase == "request":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def streamed_body(body: bytes, end_of_stream: bool, phase: Phase) -> Any:
    """FULL_DUPLEX_STREAMED: Envoy forwards only the body the picker streams back."""
    mutation = pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    )
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    if phase == "request":
        return pb.ProcessingResponse(request_body=answer)
    return pb.ProcessingResponse(response_body=answer)


def passed_on(kind: str, part: Any, duplex: bool) -> Any:
    """The answer to a response-phase message that lets it through unchanged (``duplex``: the
    response body mode is FULL_DUPLEX_STREAMED, so the chunk is streamed back)."""
    if kind == "response_headers":
        return continue_response_headers({})
    if kind == "response_body":
        if duplex:
            return streamed_body(part.body, part.end_of_stream, "response")
        return continue_body("response")
    return trailers("response")


def streamed_chunks(body: bytes, chunk_bytes: int, end_of_stream: bool) -> list[Any]:
    """The request body streamed back in chunks that stay under gRPC's message limit."""
    if not body:
        return [streamed_body(b"", end_of_stream, "request")]
    view = memoryview(body)
    last = len(body) - 1
    return [
        streamed_body(
            bytes(view[i : i + chunk_bytes]), end_of_stream and i + chunk_bytes > last, "request"
        )
        for i in range(0, len(body), chunk_bytes)
    ]


def immediate(error: GatewayError, anthropic_shape: bool = False) -> Any:
    """The error Envoy answers in the picker's place (shed, no endpoint, 4xx): OpenAI-shaped,
    or Anthropic-shaped for the Messages API."""
    headers = {"content-type": "application/json", **error.headers()}
    status, body = error.status_code, error.body()
    if anthropic_shape:
        status = anthropic.error_status(error)
        body = anthropic.error_body(error.message, status)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=header_mutation(headers),
            body=body,
            details=f"prefixgate_{error.code or error.error_type}",
        )
    )
