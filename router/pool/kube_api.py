"""The Kubernetes API server as discovery uses it: a GET, a watch of JSON lines, and where the
server is (in a cluster: the service account's namespace, CA bundle and rotating token).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import orjson

from router.config.model import DiscoveryConfig
from router.core.errors import ConfigError
from router.upstream.client import UpstreamClient

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_SECONDS = 10.0
# A pod list of a large namespace runs to megabytes; anything past this is not read.
MAX_LIST_BYTES = 64 << 20


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class PoolMissing(Exception):
    """The InferencePool does not exist (yet)."""


class ApiError(Exception):
    """The API server answered with an error status."""


class KubeApi:
    """The few API server calls discovery needs; the token is re-read on every request."""

    def __init__(self, client: UpstreamClient, server: str, token_file: str | None) -> None:
        self._client = client
        self._server = server.rstrip("/")
        self._token_file = token_file

    async def _headers(self) -> list[tuple[str, str]]:
        headers = [("accept", "application/json")]
        if not self._token_file:
            return headers
        path = Path(self._token_file)
        try:
            # Bound service account tokens rotate: read the current one each time.
            token = (await asyncio.to_thread(path.read_text)).strip()
        except OSError:
            return headers
        return [*headers, ("authorization", f"Bearer {token}")] if token else headers

    def _url(self, path: str, params: Mapping[str, str] | None) -> str:
        return self._server + path + (f"?{urlencode(params)}" if params else "")

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        got = await self._client.fetch(
            "GET", self._url(path, params), await self._headers(),
            seconds=REQUEST_SECONDS, limit=MAX_LIST_BYTES,
        )
        if got.status == 404:
            raise PoolMissing(path)
        if got.status >= 400:
            raise ApiError(f"GET {path}: {got.status}")
        data: dict[str, Any] = orjson.loads(got.body)
        return data

    async def watch(
        self, path: str, params: Mapping[str, str], server_timeout: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The watch's events, one JSON line each, until the server ends it; a read waits at
        most ``server_timeout`` + 30 s (the server ends the watch at ``server_timeout``)."""
        query = {**params, "watch": "true", "allowWatchBookmarks": "true"}
        query["timeoutSeconds"] = str(int(server_timeout))
        url, headers = self._url(path, query), await self._headers()
        async with asyncio.timeout(REQUEST_SECONDS):
            reply = await self._client.request("GET", url, headers)
        try:
            if reply.status == 410:
                raise WatchExpired(path)
            if reply.status >= 400:
                raise ApiError(f"watch {path}: {reply.status}")
            pending = b""
            while True:
                async with asyncio.timeout(server_timeout + 30.0):
                    chunk = await reply.next_chunk()
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        event: dict[str, Any] = orjson.loads(line)
                        yield event
        finally:
            reply.close()


def api_settings(config: DiscoveryConfig) -> tuple[str, ssl.SSLContext | None, str]:
    """The API server's URL, the TLS context to reach it (its CA bundle when given), and the
    namespace to watch.

    Reads the service account files and the CA store: call it through ``asyncio.to_thread``.
    """
    namespace = config.namespace
    ns_file = SERVICE_ACCOUNT_DIR / "namespace"
    if namespace is None and ns_file.is_file():
        namespace = ns_file.read_text(encoding="utf-8").strip()
    server = config.api_server
    if server is None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError("discovery.apiServer: not set and not running in a cluster")
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    tls: ssl.SSLContext | None = None
    if server.startswith("https://"):
        ca_file = config.ca_file if config.ca_file and Path(config.ca_file).is_file() else None
        tls = ssl.create_default_context(cafile=ca_file)
    return server.rstrip("/"), tls, namespace or "default"
