"""API-key auth: keys from config and environment, tenants as fairness ids, what goes upstream."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from flow_control.config import FlowControlConfig
from flow_control.controller import FlowController
from router.config.model import AuthConfig
from router.config.pool import PoolConfig
from router.core.errors import AuthenticationError, ConfigError
from router.protocol.auth import (
    ApiKeyAuthenticator,
    TenantHeaders,
    build_authenticator,
    build_upstream_keys,
    presented_key,
)
from router.serve.server import running_gateway
from tests.e2e.test_reliability_support import echo_upstream
from tests.gateways import MODEL, gateway_config

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def auth_config(**data: Any) -> AuthConfig:
    return AuthConfig.model_validate({"enabled": True, **data})


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"authorization": f"Bearer {KEY_A}"}, KEY_A),
        ({"authorization": f"bearer   {KEY_A} "}, KEY_A),
        ({"x-api-key": KEY_A}, KEY_A),
        ({"authorization": "Basic abc", "x-api-key": KEY_A}, KEY_A),
        ({"authorization": "Basic abc"}, ""),
        ({"authorization": "Bearer "}, ""),
        ({}, None),
    ],
)
def test_presented_key(headers: dict[str, str], expected: str | None) -> None:
    assert presented_key(headers) == expected


def test_keys_map_to_tenants_and_wrong_keys_are_401() -> None:
    auth = ApiKeyAuthenticator([(KEY_A, "a"), (KEY_B, "b")])
    assert auth.authenticate({"authorization": f"Bearer {KEY_A}"}) == "a"
    assert auth.authenticate({"x-api-key": KEY_B}) == "b"
    for headers in ({}, {"x-api-key": KEY_A[:-1]}, {"x-api-key": KEY_A + "x"}, {"x-api-key": ""}):
        with pytest.raises(AuthenticationError) as info:
            auth.authenticate(headers)
        assert info.value.status_code == 401
        assert KEY_A not in info.value.message
        assert orjson.loads(info.value.body())["error"]["type"] == "authentication_error"
    assert KEY_A not in repr(auth)


def test_keys_from_config_and_environment() -> None:
    environ = {"KEY_A": KEY_A, "GATEWAY_KEYS": f"b={KEY_B}, c=sk-c"}
    config = auth_config(
        apiKeys=[{"keyEnv": "KEY_A", "tenant": "a"}], apiKeysEnv="GATEWAY_KEYS"
    )
    auth = build_authenticator(config, environ)
    assert auth is not None
    assert auth.authenticate({"x-api-key": KEY_A}) == "a"
    assert auth.authenticate({"x-api-key": KEY_B}) == "b"
    assert auth.authenticate({"x-api-key": "sk-c"}) == "c"
    assert build_authenticator(AuthConfig(), environ) is None


@pytest.mark.parametrize(
    ("data", "environ", "message"),
    [
        ({}, {}, "no API keys"),
        ({"apiKeys": [{"keyEnv": "MISSING", "tenant": "a"}]}, {}, "MISSING is not set"),
        ({"apiKeysEnv": "KEYS"}, {"KEYS": f"no-equals-{KEY_A}"}, "is not 'tenant=key'"),
        (
            {"apiKeys": [{"key": KEY_A, "tenant": "a"}, {"key": KEY_A, "tenant": "b"}]},
            {},
            "two tenants",
        ),
    ],
)
def test_bad_auth_config_fails_at_start_without_echoing_keys(
    data: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_authenticator(auth_config(**data), environ)
    assert message in str(info.value)
    assert KEY_A not in str(info.value)


def test_config_never_shows_keys() -> None:
    config = gateway_config(
        ["http://127.0.0.1:1"],
        auth={"enabled": True, "apiKeys": [{"key": KEY_A, "tenant": "a"}]},
    )
    assert KEY_A not in repr(config) and KEY_A not in str(config.model_dump())


def test_upstream_keys_per_endpoint_and_pool() -> None:
    pool = PoolConfig.model_validate(
        {
            "apiKey": "pool-key",
            "endpoints": [
                {"url": "http://127.0.0.1:1"},
                {"url": "http://127.0.0.1:2", "apiKeyEnv": "E2"},
            ],
        }
    )
    keys = build_upstream_keys(pool, {"E2": "endpoint-key"})
    assert keys.header("127.0.0.1:1") == ("authorization", "Bearer pool-key")
    assert keys.header("127.0.0.1:2") == ("authorization", "Bearer endpoint-key")
    assert "pool-key" not in repr(keys)
    assert not build_upstream_keys(PoolConfig(), {})
    with pytest.raises(ConfigError):
        build_upstream_keys(PoolConfig.model_validate({"apiKeyEnv": "NOPE"}), {})


def test_tenant_becomes_the_fairness_id() -> None:
    flow = FlowController(FlowControlConfig(), lambda model: [])
    client_headers = {"x-gateway-inference-fairness-id": "someone-else", "x-session-id": "s"}
    request = flow.build_request(TenantHeaders(client_headers, "tenant-a"), MODEL)
    assert request.fairness_id == "tenant-a"
    assert request.session_id == "s"
    assert flow.build_request(TenantHeaders({}, "t"), MODEL).fairness_id == "t"


async def test_gateway_with_auth(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with echo_upstream() as echo:
        config = gateway_config(
            [echo.url],
            auth={"enabled": True, "apiKeys": [{"key": KEY_A, "tenant": "tenant-a"}]},
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            missing = await http.post("/v1/chat/completions", json=CHAT)
            wrong = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY_B}"}
            )
            models = await http.get("/v1/models")
            ok = await http.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={
                    "authorization": f"Bearer {KEY_A}",
                    "x-gateway-inference-fairness-id": "tenant-b",
                    "x-llm-d-inference-fairness-id": "tenant-b",
                },
            )
            by_header = await http.get("/v1/models", headers={"x-api-key": KEY_A})
    for resp in (missing, wrong, models):
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"
    assert ok.status_code == 200 and by_header.status_code == 200
    assert len(echo.received) == 1, "rejected requests never reach an endpoint"
    upstream = echo.received[0]
    assert "authorization" not in upstream and "x-api-key" not in upstream
    assert upstream["x-gateway-inference-fairness-id"] == "tenant-a"
    assert "x-llm-d-inference-fairness-id" not in upstream
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


async def test_upstream_key_replaces_the_clients() -> None:
    async with echo_upstream() as echo:
        config = gateway_config(
            [echo.url],
            pool={"endpoints": [{"url": echo.url, "apiKey": "upstream-secret"}]},
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer client"}
            )
    assert resp.status_code == 200
    assert echo.received[0]["authorization"] == "Bearer upstream-secret"
    # Model discovery on vLLM's guarded /v1/models presents the endpoint's key too.
    assert echo.models_headers[0]["authorization"] == "Bearer upstream-secret"


async def test_forward_client_key_when_configured() -> None:
    async with echo_upstream() as echo:
        config = gateway_config(
            [echo.url],
            auth={
                "enabled": True,
                "apiKeys": [{"key": KEY_A, "tenant": "a"}],
                "forwardClientKey": True,
            },
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": KEY_A})
    assert resp.status_code == 200
    assert echo.received[0]["x-api-key"] == KEY_A


async def test_a_tenant_named_outside_latin_1_is_served_not_a_500() -> None:
    """A tenant is any string in the config (``auth.apiKeys[].tenant``); it goes upstream as
    the fairness header. Written as it was, the request head could not be encoded, and every
    request of that tenant was a 500 (a UnicodeEncodeError out of the upstream client)."""
    tenant = "研究チーム"
    key = "sk-tenant-0123456789"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with echo_upstream() as echo:
        config = gateway_config(
            [echo.url], auth={"enabled": True, "apiKeys": [{"key": key, "tenant": tenant}]}
        )
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            resp = await http.post(
                "/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {key}"}
            )
    assert resp.status_code == 200, resp.text
    # Headers arrive latin-1 decoded: these are the tenant's UTF-8 bytes.
    sent = echo.received[0]["x-gateway-inference-fairness-id"]
    assert sent.encode("latin-1").decode() == tenant


def test_an_empty_configured_key_is_refused_not_matched_by_a_malformed_header() -> None:
    """A malformed ``Authorization`` (not Bearer, or Bearer with nothing after it) presents
    the key "": an empty literal key in the config (``key: ""``, a template that rendered
    empty) used to match it, so any such header authenticated as that tenant. The config is
    refused, as an empty key from the environment already is."""
    config = auth_config(apiKeys=[{"key": "", "tenant": "a"}, {"key": KEY_B, "tenant": "b"}])
    with pytest.raises(ConfigError) as info:
        build_authenticator(config, {})
    assert "auth.apiKeys[0]" in str(info.value)
    # Nor does an authenticator given one anyhow let a malformed header in.
    auth = ApiKeyAuthenticator([("", "a"), (KEY_B, "b")])
    for headers in ({"authorization": "Basic Zm9vOmJhcg=="}, {"authorization": "Bearer "}):
        with pytest.raises(AuthenticationError):
            auth.authenticate(headers)


def test_a_key_outside_latin_1_matches_its_utf8_bytes_not_question_marks() -> None:
    """Headers arrive latin-1 decoded (each byte one character), so a client's key is its
    bytes; a configured key is text, whose bytes are its UTF-8. Encoded as latin-1 with
    'replace', ``sk-ключ`` was digested as ``sk-????``: its owner's key never matched, and
    the ASCII ``sk-????`` did."""
    key = "sk-ключ-0123456789"
    guess = key.encode("latin-1", "replace").decode("latin-1")
    for config, environ in (
        (auth_config(apiKeys=[{"key": key, "tenant": "a"}]), {}),
        (auth_config(apiKeysEnv="KEYS"), {"KEYS": f"a={key}"}),
    ):
        auth = build_authenticator(config, environ)
        assert auth is not None
        as_received = key.encode().decode("latin-1")  # what Starlette's headers hold
        assert auth.authenticate({"x-api-key": as_received}) == "a"
        assert auth.authenticate({"authorization": f"Bearer {as_received}"}) == "a"
        with pytest.raises(AuthenticationError):
            auth.authenticate({"x-api-key": guess})


def test_upstream_keys_are_trimmed_and_an_empty_or_broken_one_is_refused() -> None:
    """A client key is trimmed and refused empty; an upstream key was taken as written: a
    YAML block scalar's trailing newline went into the ``Authorization`` line (a request the
    replica rejects, or a header injected), and ``apiKey: ""`` sent ``Bearer `` in place of
    the pool's key."""
    pool = PoolConfig.model_validate(
        {"apiKey": " pool-key\n", "endpoints": [{"url": "http://127.0.0.1:1"}]}
    )
    keys = build_upstream_keys(pool, {})
    assert keys.header("127.0.0.1:1") == ("authorization", "Bearer pool-key")
    # Header values stand for latin-1 bytes (router.upstream.client writes them so): a key
    # beyond latin-1 goes as its UTF-8 bytes, as a tenant name does, not as a failed request.
    unicode = build_upstream_keys(PoolConfig.model_validate({"apiKey": "sk-ключ"}), {})
    as_bytes = "sk-ключ".encode().decode("latin-1")
    assert unicode.header("e") == ("authorization", f"Bearer {as_bytes}")
    for data, where in (
        ({"apiKey": ""}, "pool.apiKey"),
        ({"endpoints": [{"url": "http://127.0.0.1:1", "apiKey": "  "}]}, "pool.endpoints[0]"),
        ({"apiKey": "sk-a\r\nx-injected: 1"}, "pool.apiKey"),
    ):
        with pytest.raises(ConfigError) as info:
            build_upstream_keys(PoolConfig.model_validate(data), {})
        assert where in str(info.value) and "sk-a" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        build_upstream_keys(PoolConfig.model_validate({"apiKeyEnv": "K"}), {"K": "a\nb"})
    assert "pool.apiKeyEnv" in str(info.value)
