"""The gateway's header policy: what a client may send upstream, what comes back to it."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from router.protocol.auth import FAIRNESS_HEADER, KEY_HEADERS, UpstreamKeys

DESTINATION_HEADER = "x-gateway-destination-endpoint"
REQUEST_ID_HEADER = "x-request-id"
# A client asks why its request went where it went (honoured when server.explainHeader is on);
# the answer comes back in DECISION_HEADER.
EXPLAIN_HEADER = "x-prefixgate-explain"
DECISION_HEADER = "x-prefixgate-decision"
DECISION_HEADER_ENDPOINTS = 8  # the best few: a header must stay well under proxies' limits
# A client's request id is echoed in headers and logs: only a short, plain token is honoured.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# The routing headers only the gateway (or the endpoint picker) sets, besides the destination:
# a client's own would be an SSRF hole. Every spelling llm-d's routing sidecar reads
# (prefiller, KV-cache source, encoders, data-parallel rank: each names a host the decoder
# would reach), and the picker protocol's subset hint, fallback and served endpoint.
ROUTING_HEADERS = (
    "x-gateway-destination-endpoint-subset", "x-gateway-destination-endpoint-served",
    "x-gateway-destination-endpoint-fallback",
    "x-prefiller-host-port", "x-prefiller-url", "x-decoder-host-port",
    "x-llm-d-prefiller-host-port", "x-kv-cache-source-host-port",
    "x-llm-d-kv-cache-source-host-port", "x-encoder-hosts-ports", "x-llm-d-encoder-hosts-ports",
    "x-data-parallel-host-port",
)
# Headers a client may never set for the upstream: hop-by-hop ones, and the routing headers.
DROP_REQUEST_HEADERS = frozenset(
    h.encode()
    for h in (
        "host", "content-length", "connection", "keep-alive", "proxy-authenticate",
        "proxy-authorization", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "expect", DESTINATION_HEADER, *ROUTING_HEADERS,
        "x-gateway-request-dropped-reason", "x-llm-d-request-dropped-reason", REQUEST_ID_HEADER,
        EXPLAIN_HEADER, DECISION_HEADER,
    )
)
DROP_RESPONSE_HEADERS = frozenset(
    h.encode()
    for h in (
        "connection", "keep-alive", "proxy-authenticate", "proxy-connection", "te",
        "transfer-encoding", "upgrade", "trailer", "server", "date", DESTINATION_HEADER,
        REQUEST_ID_HEADER, DECISION_HEADER,
    )
)
FAIRNESS_HEADERS = frozenset(
    h.encode() for h in ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
)


def _dropped(raw: Sequence[tuple[bytes, bytes]], drop: frozenset[bytes]) -> frozenset[bytes]:
    """``drop`` and the fields the message's Connection header names: hop-by-hop for this
    message alone, removed by whoever forwards it (RFC 9110 7.6.1)."""
    named = [value for name, value in raw if name.lower() == b"connection"]
    if not named:
        return drop
    return drop | {o.strip().lower() for value in named for o in value.split(b",")}


class RequestHeaders(Mapping[str, str]):
    """A request's headers by name, read as Starlette's ``Headers`` reads them (the first
    value of a name, any case asked), from a dict built once: the request path asks a dozen
    names, most absent, and ``Headers`` scans the list and raises a ``KeyError`` for each."""

    __slots__ = ("_map", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        found: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1")
            if key not in found:
                found[key] = value.decode("latin-1")
        self._map = found

    def get(self, key: str, default: Any = None) -> Any:
        return self._map.get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return self._map[key.lower()]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


class RequestIds:
    """Fresh request ids: a random per-instance prefix and a counter, 32 hex digits like a
    uuid4's. Unique across processes and restarts (the prefix), cheaper than uuid4 per
    request (no system entropy per id)."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


def request_id_of(headers: Mapping[str, str], fresh: RequestIds | None = None) -> str:
    """The client's id when it is a short plain token, else a fresh one."""
    value = headers.get(REQUEST_ID_HEADER)
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return fresh() if fresh is not None else os.urandom(16).hex()


def response_headers(
    raw: Sequence[tuple[bytes, bytes]],
    endpoint_id: str,
    request_id: str,
    explanation: Mapping[str, Any] | None = None,
) -> list[tuple[bytes, bytes]]:
    drop = _dropped(raw, DROP_RESPONSE_HEADERS)
    headers = [(k.lower(), v) for k, v in raw if k.lower() not in drop]
    headers.append((DESTINATION_HEADER.encode(), endpoint_id.encode()))
    headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
    if explanation is not None:
        shown = {**explanation, "endpoints": explanation["endpoints"][:DECISION_HEADER_ENDPOINTS]}
        headers.append((DECISION_HEADER.encode(), orjson.dumps(shown)))
    return headers


class ForwardedHeaders:
    """What a request carries upstream: the client's headers minus every one that could steer
    routing (behind authentication also the client's fairness id, and its key unless it is
    forwarded on purpose), plus the request id, the tenant and the endpoint's own key."""

    __slots__ = ("_drop", "keys")

    def __init__(self, keys: UpstreamKeys, authenticated: bool, forward_client_key: bool) -> None:
        drop = set(DROP_REQUEST_HEADERS)
        if authenticated:
            drop |= FAIRNESS_HEADERS  # replaced by the tenant's
            if not forward_client_key:
                drop |= {h.encode() for h in KEY_HEADERS}
        self._drop = frozenset(drop)
        self.keys = keys

    def base(
        self, raw: Sequence[tuple[bytes, bytes]], request_id: str, tenant: str | None
    ) -> list[tuple[str, str]]:
        drop = _dropped(raw, self._drop)
        headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k.lower() not in drop
        ]
        headers.append((REQUEST_ID_HEADER, request_id))
        if tenant is not None:
            # The values above stand for the client's bytes (latin-1); the tenant is text from
            # the config, which may be any Unicode: sent as its UTF-8 bytes.
            headers.append((FAIRNESS_HEADER, tenant.encode().decode("latin-1")))
        return headers

    def keyed(self, headers: list[tuple[str, str]], endpoint_id: str) -> list[tuple[str, str]]:
        key = self.keys.header(endpoint_id) if self.keys else None
        if key is None:
            return headers
        # The endpoint's own key replaces whatever the client sent.
        return [h for h in headers if h[0].lower() not in KEY_HEADERS] + [key]
