"""The header policy: what a client may send upstream, what comes back."""

from __future__ import annotations

from starlette.datastructures import Headers

from router.protocol.auth import UpstreamKeys
from router.protocol.headers import (
    ForwardedHeaders,
    RequestHeaders,
    RequestIds,
    request_id_of,
    response_headers,
)

RAW = [
    (b"Content-Type", b"application/json"),
    (b"x-gateway-destination-endpoint", b"169.254.169.254:80"),
    (b"x-prefiller-host-port", b"10.0.0.9:8000"),
    (b"x-gateway-inference-fairness-id", b"someone-else"),
    (b"Authorization", b"Bearer client-key"),
    (b"x-request-id", b"spoofed"),
]


def test_routing_headers_never_go_upstream() -> None:
    headers = dict(ForwardedHeaders(UpstreamKeys(), False, False).base(RAW, "rid", None))
    assert "x-gateway-destination-endpoint" not in headers
    assert "x-prefiller-host-port" not in headers
    assert headers["x-request-id"] == "rid"
    # Without authentication the client's fairness id and key pass through.
    assert headers["x-gateway-inference-fairness-id"] == "someone-else"
    assert headers["Authorization"] == "Bearer client-key"


def test_behind_authentication_the_tenant_and_endpoint_key_replace_the_clients() -> None:
    forwarded = ForwardedHeaders(UpstreamKeys(by_endpoint={"e1": "k1"}), True, False)
    base = forwarded.base(RAW, "rid", "tenant-a")
    names = [k.lower() for k, _ in base]
    assert "authorization" not in names
    assert names.count("x-gateway-inference-fairness-id") == 1
    assert dict(base)["x-gateway-inference-fairness-id"] == "tenant-a"
    assert dict(forwarded.keyed(base, "e1"))["authorization"] == "Bearer k1"
    assert forwarded.keyed(base, "e2") == base
    kept = ForwardedHeaders(UpstreamKeys(), True, True).base(RAW, "rid", "tenant-a")
    assert dict(kept)["Authorization"] == "Bearer client-key"


def test_request_ids_and_response_headers() -> None:
    assert request_id_of({"x-request-id": "abc-123"}) == "abc-123"
    assert request_id_of({"x-request-id": "bad id with spaces"}) != "bad id with spaces"
    ids = RequestIds()
    fresh = {request_id_of({}, ids) for _ in range(1000)} | {request_id_of({}, RequestIds())}
    assert len(fresh) == 1001, "unique within an instance and across instances"
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in fresh)
    out = dict(response_headers([(b"Server", b"vllm"), (b"X-Other", b"1")], "e1", "rid"))
    assert b"server" not in out
    assert out[b"x-other"] == b"1"
    assert out[b"x-gateway-destination-endpoint"] == b"e1"


def test_request_headers_answer_as_starlettes_do() -> None:
    raw = [(b"x-session-id", b"s1"), (b"content-type", b"a/b"), (b"x-session-id", b"s2"),
           (b"x-caf\xe9", b"\xe9t\xe9")]
    ours, theirs = RequestHeaders(raw), Headers(raw=raw)
    for name in ("x-session-id", "X-Session-ID", "content-type", "x-caf\xe9", "absent"):
        assert ours.get(name) == theirs.get(name)
        assert (name in ours) == (name in theirs)
    assert ours["X-SESSION-ID"] == "s1" and ours.get("absent", "d") == "d"
    assert list(ours) == ["x-session-id", "content-type", "x-caf\xe9"] and len(ours) == 3
    assert ours.raw is raw


def test_headers_a_connection_header_names_are_hop_by_hop_both_ways() -> None:
    """RFC 9110 7.6.1: a proxy removes the fields its Connection header names, and the
    proxy-only fields, before forwarding, whichever way the message goes."""
    sent = [
        (b"Connection", b"keep-alive, X-Hop-A"),
        (b"connection", b"x-hop-b"),
        (b"X-Hop-A", b"1"),
        (b"x-hop-b", b"2"),
        (b"x-kept", b"3"),
    ]
    forwarded = dict(ForwardedHeaders(UpstreamKeys(), False, False).base(sent, "rid", None))
    assert "x-kept" in forwarded
    assert not {"X-Hop-A", "x-hop-b", "Connection", "connection"} & set(forwarded)
    answered = [*sent, (b"Proxy-Authenticate", b"Basic"), (b"Proxy-Connection", b"close")]
    back = dict(response_headers(answered, "e1", "rid"))
    assert b"x-kept" in back
    assert not {b"x-hop-a", b"x-hop-b", b"proxy-authenticate", b"proxy-connection"} & set(back)
