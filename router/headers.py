"""The gateway's header policy: what a client may send upstream, what comes back to it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

DESTINATION_HEADER = "x-gateway-destination-endpoint"
REQUEST_ID_HEADER = "x-request-id"
# A client asks why its request went where it went (honoured when server.explainHeader is on);
# the answer comes back in DECISION_HEADER.
EXPLAIN_HEADER = "x-prefixgate-explain"
DECISION_HEADER = "x-prefixgate-decision"
DECISION_HEADER_ENDPOINTS = 8  # the best few: a header must stay well under proxies' limits
# A client's request id is echoed in headers and logs: only a short, plain token is honoured.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# Headers a client may never set for the upstream: hop-by-hop ones, and the gateway's own
# routing headers (a client-chosen destination or prefiller would be an SSRF hole).
DROP_REQUEST_HEADERS = frozenset(
    h.encode()
    for h in (
        "host", "content-length", "connection", "keep-alive", "proxy-authenticate",
        "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "expect", DESTINATION_HEADER, "x-gateway-destination-endpoint-subset",
        "x-gateway-destination-endpoint-served", "x-prefiller-host-port", "x-prefiller-url",
        "x-decoder-host-port", "x-gateway-request-dropped-reason", REQUEST_ID_HEADER,
        EXPLAIN_HEADER, DECISION_HEADER,
    )
)
DROP_RESPONSE_HEADERS = frozenset(
    h.encode()
    for h in (
        "connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "server",
        "date", DESTINATION_HEADER, REQUEST_ID_HEADER, DECISION_HEADER,
    )
)
FAIRNESS_HEADERS = frozenset(
    h.encode() for h in ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
)


def request_id_of(headers: Mapping[str, str]) -> str:
    value = headers.get(REQUEST_ID_HEADER)
    return value if value and _REQUEST_ID.fullmatch(value) else uuid.uuid4().hex


def response_headers(
    raw: Iterable[tuple[bytes, bytes]],
    endpoint_id: str,
    request_id: str,
    explanation: Mapping[str, Any] | None = None,
) -> list[tuple[bytes, bytes]]:
    headers = [(k.lower(), v) for k, v in raw if k.lower() not in DROP_RESPONSE_HEADERS]
    headers.append((DESTINATION_HEADER.encode(), endpoint_id.encode()))
    headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
    if explanation is not None:
        shown = {**explanation, "endpoints": explanation["endpoints"][:DECISION_HEADER_ENDPOINTS]}
        headers.append((DECISION_HEADER.encode(), orjson.dumps(shown)))
    return headers
