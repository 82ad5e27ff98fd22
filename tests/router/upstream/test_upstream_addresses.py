"""The upstream client's addresses: https endpoints verified, host names resolved and dialled."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest

from router.upstream.client import (
    UPSTREAM_ERRORS,
    UpstreamClient,
)
from tests.router.upstream.test_upstream import keep_answering, ok, read_request, serve


async def test_https_endpoints_are_verified(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            await read_request(reader)
            writer.write(ok(b"secure"))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/x"
    try:
        client = UpstreamClient(8, 2, ssl_context=trusting)
        reply = await asyncio.wait_for(client.post(url, [], b"{}"), 5)
        assert await reply.read_all() == b"secure"
        reply.close()
        await client.aclose()
        untrusting = UpstreamClient(8, 2)  # the system's CAs do not know this certificate
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.wait_for(untrusting.post(url, [], b"{}"), 5)
        await untrusting.aclose()
    finally:
        server.close()


async def test_a_host_name_is_resolved_once_per_ttl_and_again_after_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    lookups: list[str] = []
    resolve = loop.getaddrinfo

    async def counting(host: Any, *args: Any, **kwargs: Any) -> Any:
        lookups.append(host)
        return await resolve(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", counting)
    client = UpstreamClient(8, 2, keepalive_seconds=0.0)  # every request dials anew
    async with serve(keep_answering) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        for _ in range(3):
            reply = await client.post(url, [], b"x")
            await reply.read_all()
            reply.close()
        assert server.connections == 3 and lookups == ["localhost"]
    with pytest.raises(UPSTREAM_ERRORS):  # the server is gone: the cached address fails
        await asyncio.wait_for(client.post(url, [], b"x"), 2)
    with pytest.raises(UPSTREAM_ERRORS):
        await asyncio.wait_for(client.post(url, [], b"x"), 2)
    assert lookups == ["localhost", "localhost"]  # asked again after the failure
    await client.aclose()


async def test_a_name_whose_first_address_refuses_is_dialled_at_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    dialled: list[str] = []
    connect = loop.create_connection

    async def fake_lookup(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        assert host == "replica.test"
        stream = socket.SOCK_STREAM
        # 127.0.0.2 is loopback too, but nothing listens there: refused, as an IPv6 address
        # the server does not bind would be.
        return [(socket.AF_INET, stream, 6, "", ("127.0.0.2", port)),
                (socket.AF_INET, stream, 6, "", ("127.0.0.1", port))]

    async def recording(factory: Any, host: Any, *args: Any, **kwargs: Any) -> Any:
        dialled.append(host)
        return await connect(factory, host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", fake_lookup)
    monkeypatch.setattr(loop, "create_connection", recording)
    client = UpstreamClient(8, 2, keepalive_seconds=0.0)
    async with serve(keep_answering) as server:
        url = server.url.replace("127.0.0.1", "replica.test")
        for _ in range(2):
            reply = await asyncio.wait_for(client.post(url, [], b"x"), 2)
            assert await reply.read_all()
            reply.close()
    assert dialled == ["127.0.0.2", "127.0.0.1", "127.0.0.1"]  # the one that answered first
    await client.aclose()
