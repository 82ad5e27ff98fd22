"""Optional API-key authentication of clients, and the keys the gateway presents upstream.

Each client key is bound to a tenant, which becomes the request's fairness id: with auth on, a
client cannot pick another tenant's queue by sending ``x-gateway-inference-fairness-id``.

Client keys are kept only as SHA-256 digests, and a presented key is compared with
``hmac.compare_digest`` against every known digest without stopping at a match, so the time
taken says nothing about how close a guess was. Keys never reach logs, error messages or reprs
(the config holds them as ``SecretStr``; the error says "invalid", never which key).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from flow_control.resolve import FAIRNESS_HEADERS
from router.config.model import AuthConfig
from router.config.pool import PoolConfig
from router.core.endpoints import endpoint_id_from_url
from router.core.errors import AuthenticationError, ConfigError

FAIRNESS_HEADER = FAIRNESS_HEADERS[0]
# Where clients put their key; both are dropped before forwarding unless configured otherwise.
KEY_HEADERS = ("authorization", "x-api-key")


class Authenticator(Protocol):
    """Decides who a request is; the returned tenant becomes its fairness id."""

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The tenant of the request, or raise :class:`AuthenticationError`."""
        ...


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _presented_bytes(key: str) -> bytes:
    # Headers arrive latin-1 decoded: re-encoding so restores the bytes the client sent (a
    # character past latin-1 cannot come from a header's bytes: text, sent as its UTF-8).
    try:
        return key.encode("latin-1")
    except UnicodeEncodeError:
        return key.encode()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key of ``Authorization: Bearer <key>`` or ``x-api-key``; "" if malformed."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = headers.get("x-api-key")
    if api_key and api_key.strip():
        return api_key.strip()
    return "" if authorization else None


class ApiKeyAuthenticator:
    """Static API keys, each bound to one tenant."""

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        # A configured key is text, which a client sends as its UTF-8 bytes. An empty one
        # would match the "" a malformed Authorization header presents: never kept.
        self._entries = [(_digest(key.encode()), tenant) for key, tenant in keys if key]

    def __repr__(self) -> str:
        return f"ApiKeyAuthenticator({len(self._entries)} keys)"

    def authenticate(self, headers: Mapping[str, str]) -> str:
        key = presented_key(headers)
        if key is None:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        digest = _digest(_presented_bytes(key))
        tenant: str | None = None
        for known, owner in self._entries:
            if hmac.compare_digest(known, digest):
                tenant = owner
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant


def _from_env(environ: Mapping[str, str], name: str, where: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{where}: environment variable {name} is not set or empty")
    return value


def _parse_key_list(text: str, name: str) -> list[tuple[str, str]]:
    """``tenant=key,tenant=key`` from an environment variable (never echoed in errors)."""
    pairs: list[tuple[str, str]] = []
    for n, item in enumerate(part.strip() for part in text.split(",")):
        if not item:
            continue
        tenant, sep, key = item.partition("=")
        if not sep or not tenant.strip() or not key.strip():
            raise ConfigError(f"auth.apiKeysEnv: entry {n} of {name} is not 'tenant=key'")
        pairs.append((key.strip(), tenant.strip()))
    return pairs


def build_authenticator(
    config: AuthConfig, environ: Mapping[str, str]
) -> ApiKeyAuthenticator | None:
    """The authenticator ``auth`` describes (None when off); keys from config and env."""
    if not config.enabled:
        return None
    keys: list[tuple[str, str]] = []
    for i, entry in enumerate(config.api_keys):
        if entry.key is not None:
            key = entry.key.get_secret_value().strip()
            if not key:
                raise ConfigError(f"auth.apiKeys[{i}].key is empty")
        else:
            assert entry.key_env is not None  # enforced by the config model
            key = _from_env(environ, entry.key_env, f"auth.apiKeys[{i}].keyEnv")
        keys.append((key, entry.tenant))
    if config.api_keys_env:
        name = config.api_keys_env
        keys += _parse_key_list(_from_env(environ, name, "auth.apiKeysEnv"), name)
    if not keys:
        raise ConfigError("auth.enabled: no API keys given (auth.apiKeys or auth.apiKeysEnv)")
    owners: dict[str, str] = {}
    for key, tenant in keys:
        if owners.setdefault(key, tenant) != tenant:
            raise ConfigError(f"auth: one key is bound to two tenants ({owners[key]}, {tenant})")
    return ApiKeyAuthenticator(keys)


class UpstreamKeys:
    """The key the gateway sends each endpoint: the endpoint's own, else the pool's."""

    __slots__ = ("_by_endpoint", "_default")

    def __init__(
        self, default: str | None = None, by_endpoint: Mapping[str, str] | None = None
    ) -> None:
        self._default = _bearer(default) if default else None
        self._by_endpoint = {eid: _bearer(key) for eid, key in (by_endpoint or {}).items()}

    def __repr__(self) -> str:
        return f"UpstreamKeys({len(self._by_endpoint) + bool(self._default)} keys)"

    def __bool__(self) -> bool:
        return bool(self._default or self._by_endpoint)

    def header(self, endpoint_id: str) -> tuple[str, str] | None:
        value = self._by_endpoint.get(endpoint_id, self._default)
        return ("authorization", value) if value else None

    def headers(self, endpoint_id: str) -> Mapping[str, str]:
        pair = self.header(endpoint_id)
        return dict([pair]) if pair else {}


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def _one_key(key: object, env: str | None, environ: Mapping[str, str], where: str) -> str | None:
    if key is not None and env is not None:
        raise ConfigError(f"{where}: give apiKey or apiKeyEnv, not both")
    if env is not None:
        where, value = f"{where}.apiKeyEnv", _from_env(environ, env, f"{where}.apiKeyEnv")
    else:
        get = getattr(key, "get_secret_value", None)
        if get is None:
            return None
        where, value = f"{where}.apiKey", str(get()).strip()
    # Trimmed like a client key: a YAML block scalar's newline would otherwise end the
    # Authorization line early. Never echoed in the error.
    if not value:
        raise ConfigError(f"{where} is empty")
    if not value.isprintable():
        raise ConfigError(f"{where} holds a control character (a line break?)")
    # Header values stand for latin-1 bytes: text beyond it goes as its UTF-8 bytes.
    return value.encode().decode("latin-1")


def build_upstream_keys(pool: PoolConfig, environ: Mapping[str, str]) -> UpstreamKeys:
    default = _one_key(pool.api_key, pool.api_key_env, environ, "pool")
    by_endpoint: dict[str, str] = {}
    for i, endpoint in enumerate(pool.endpoints):
        where = f"pool.endpoints[{i}]"
        key = _one_key(endpoint.api_key, endpoint.api_key_env, environ, where)
        if key is not None:
            by_endpoint[endpoint_id_from_url(endpoint.url)] = key
    return UpstreamKeys(default, by_endpoint)


class TenantHeaders(Mapping[str, str]):
    """A request's headers as flow control reads them, the fairness id forced to the tenant."""

    __slots__ = ("_headers", "_tenant")

    def __init__(self, headers: Mapping[str, str], tenant: str) -> None:
        self._headers = headers
        self._tenant = tenant

    def __getitem__(self, name: str) -> str:
        if name.lower() in FAIRNESS_HEADERS:
            return self._tenant
        return self._headers[name]

    def __iter__(self) -> Iterator[str]:
        yield from FAIRNESS_HEADERS
        yield from (k for k in self._headers if k.lower() not in FAIRNESS_HEADERS)

    def __len__(self) -> int:
        return sum(1 for _ in self)
