"""The upstream HTTP/1.1 client the proxy forwards requests with.

Its own small client on ``asyncio.Protocol`` and httptools (``router.upstream.connection``)
rather than a general one, because this path runs once per request and once per streamed
token, and a burst of sub-agent requests pays it in series on the one event loop: measured with
``benchmarks.overhead`` and ``benchmarks.relay_cost``, it costs the gateway less CPU than httpx
or aiohttp (docs/benchmarks/gateway-cost.md), and so it does for the gateway's other calls
(scrapes, health checks, the tokenizer, the Kubernetes API; ``benchmarks.http_clients``,
docs/benchmarks/http-client.md), which use it too, through :meth:`UpstreamClient.fetch`.

Connections are pooled per endpoint, most recently used first, and a pooled connection idle for
``keepalive_seconds`` is not used again: servers close idle ones on their own clock (uvicorn,
and so vLLM, after 5 s), and a request written into a connection the server is closing is lost.
For the same race, a request whose reused connection fails before any byte of an answer goes
once more on a new connection: an idempotent one always; another (a POST) only when the failure
came within ``STALE_CLOSE_S`` of writing it, as a close already on its way does, since an
endpoint that read it and then failed would run it twice (RFC 9110 9.2.2).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from router.upstream.connection import (
    Connection,
    UpstreamConnectionError,
    UpstreamProtocolError,
)

# How long a resolved endpoint host name is dialled without asking DNS again (aiohttp's default
# too): a burst that opens connections to one replica must not queue getaddrinfo calls on the
# loop's thread pool, and a replaced pod behind a name is picked up within a minute.
DNS_TTL_SECONDS = 60.0

# What can go wrong talking to an endpoint, short of a bug: the proxy retries or reports these.
# UpstreamConnectionError and UpstreamProtocolError are ConnectionErrors, so OSErrors too.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError)

__all__ = [
    "UPSTREAM_ERRORS", "Fetched", "ResponseTooLargeError", "UpstreamClient",
    "UpstreamConnectionError", "UpstreamProtocolError", "UpstreamReply",
]


class ResponseTooLargeError(UpstreamProtocolError):
    """An answer read whole (:meth:`UpstreamClient.fetch`) ran past its byte limit."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """A small answer read whole: a health check, a scrape, a tokenizer's or the API server's."""

    status: int
    body: bytes


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    tls: bool
    path: str
    host_header: str

    @property
    def key(self) -> tuple[str, int, bool]:
        return (self.host, self.port, self.tls)


@lru_cache(maxsize=4096)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Host is the URL's host and port only (RFC 9110 7.2): any user:password@ stays out.
    return _Target(parts.hostname, port, tls, path, parts.netloc.rpartition("@")[2])


class UpstreamReply:
    """An upstream response whose status line and headers have arrived."""

    __slots__ = ("_client", "_conn", "_released")

    def __init__(self, client: UpstreamClient, conn: Connection) -> None:
        self._client = client
        self._conn = conn
        self._released = False

    @property
    def status(self) -> int:
        return self._conn.status

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self._conn.headers

    @property
    def content_type(self) -> str:
        for name, value in self._conn.headers:
            if name.lower() == b"content-type":
                return value.decode("latin-1")
        return ""

    @property
    def ended(self) -> bool:
        """Every byte of the body was handed out (the next chunk is ``b""``)."""
        return self._conn.drained

    async def next_chunk(self) -> bytes:
        """The next piece of the body as it arrives; ``b""`` at its end."""
        return await self._conn.next_chunk()

    async def read_all(self, limit: int = 1 << 20) -> bytes:
        parts: list[bytes] = []
        size = 0
        while size < limit:
            chunk = await self.next_chunk()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back when the body was read to its end; otherwise drop it,
        which is what tells the replica to abort the request."""
        if not self._released:
            self._released = True
            self._client.release(self._conn)


# Methods a request of which may be sent twice (RFC 9110 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# A reused connection that fails this soon after a request was written into it was closing
# already (a round trip on a loaded machine); later, the endpoint may have read the request.
STALE_CLOSE_S = 0.5


class UpstreamClient:
    def __init__(
        self,
        max_connections: int,
        connect_timeout: float,
        keepalive_seconds: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Requests in flight to each endpoint, at most max_connections: one that hangs takes
        # no other endpoint's slots. Per endpoint, the requests holding or awaiting a slot.
        self._max = max_connections
        self._slots: dict[tuple[str, int, bool], asyncio.Semaphore] = {}
        self._holders: dict[tuple[str, int, bool], int] = {}
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive_seconds
        self._clock = clock
        self._ssl = ssl_context
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._swept_at = clock()
        self._dns: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def post(
        self, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> UpstreamReply:
        return await self.request("POST", url, headers, body)

    async def request(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes = b""
    ) -> UpstreamReply:
        """Write the request, wait for the answer's head. Any method (GET/DELETE of a stored
        response, say); a Content-Length when there is a body or the method expects one."""
        target = _target(url)
        head = _head(method, target, headers, body)
        data = [head, body] if body else [head]
        key = target.key
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = asyncio.Semaphore(self._max)
        self._holders[key] = self._holders.get(key, 0) + 1
        try:
            await slots.acquire()
        except BaseException:
            self._let_go(key)
            raise
        try:
            conn = await self._exchange(target, data, method)
        except BaseException:
            self._release_slot(key)
            raise
        return UpstreamReply(self, conn)

    def _release_slot(self, key: tuple[str, int, bool]) -> None:
        self._slots[key].release()
        self._let_go(key)

    def _let_go(self, key: tuple[str, int, bool]) -> None:
        left = self._holders[key] - 1
        if left:
            self._holders[key] = left
        else:  # nobody holds or awaits one: an endpoint that left leaves nothing behind
            del self._holders[key], self._slots[key]

    async def fetch(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        seconds: float,
        limit: int = 1 << 20,
    ) -> Fetched:
        """The whole answer within ``seconds`` (connect, head and body), at most ``limit``
        bytes of it: the monitor's, the tokenizer's and discovery's calls, off the hot path."""
        reply: UpstreamReply | None = None
        try:
            async with asyncio.timeout(seconds):
                reply = await self.request(method, url, headers, body)
                data = await reply.read_all(limit + 1)
                if len(data) > limit:
                    raise ResponseTooLargeError(f"{url}: answer over {limit} bytes")
                return Fetched(reply.status, data)
        finally:
            if reply is not None:
                reply.close()

    async def _exchange(self, target: _Target, data: list[bytes], method: str) -> Connection:
        bodiless = method == "HEAD"
        conn = self._pooled(target.key)
        if conn is not None:
            sent_at = self._clock()
            try:
                await _send(conn, data, bodiless)
                return conn
            except OSError:
                if conn.answered:
                    raise
                if method not in _IDEMPOTENT and self._clock() - sent_at > STALE_CLOSE_S:
                    raise  # the endpoint may have read it: the caller's to retry, or not
                # Closed by the endpoint while idle, as the request was written (see above).
        conn = await self._connect(target)
        await _send(conn, data, bodiless)
        return conn

    def _pooled(self, key: tuple[str, int, bool]) -> Connection | None:
        idle = self._idle.get(key)
        now = self._clock()
        while idle:
            conn = idle.pop()
            conn.on_lost = None
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target) -> Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._ssl is None:  # built once: loading the CA store takes milliseconds
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout):
                addresses = await self._addresses(loop, target.host, target.port)
                conn = await self._dial(loop, addresses, target, tls)
        except OSError:
            self._dns.pop((target.host, target.port), None)  # ask again next time
            raise
        conn.key = target.key
        return conn

    async def _dial(
        self,
        loop: asyncio.AbstractEventLoop,
        addresses: list[str],
        target: _Target,
        tls: ssl.SSLContext | None,
    ) -> Connection:
        """The first of a name's addresses that accepts (a name may have an IPv6 address its
        server does not listen on); that one is tried first from then on."""
        error: OSError | None = None
        for address in list(addresses):
            try:
                _, conn = await loop.create_connection(
                    lambda: Connection(loop), address, target.port, ssl=tls,
                    server_hostname=target.host if tls else None,
                )
            except OSError as exc:
                error = exc
                continue
            if address != addresses[0]:
                addresses.remove(address)
                addresses.insert(0, address)
            return conn
        raise error or OSError(f"{target.host} has no address")

    async def _addresses(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> list[str]:
        """The addresses to dial for ``host``: itself if it is one, else a cached lookup."""
        if _is_ip(host):
            return [host]
        now = time.monotonic()
        cached = self._dns.get((host, port))
        if cached is not None and now - cached[0] < DNS_TTL_SECONDS:
            return cached[1]
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addresses:
            raise OSError(f"{host} did not resolve")
        self._dns[(host, port)] = (now, addresses)
        return addresses

    def release(self, conn: Connection) -> None:
        """A reply is done with its connection: pool it if its answer ended cleanly."""
        self._release_slot(conn.key)
        if self._closed or not conn.reusable:
            conn.close()
            return
        now = self._clock()
        conn.idle_since = now
        conn.on_lost = self._lost
        self._idle.setdefault(conn.key, []).append(conn)
        if now - self._swept_at >= self._keepalive:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close the pooled connections idle past the keep-alive, every endpoint's. A server
        closes its idle ones itself, but one that vanished without a reset (its node lost)
        never does, and no request to it takes them out of the pool: their sockets would stay
        for the life of the gateway."""
        self._swept_at = now
        for key, idle in list(self._idle.items()):
            # Oldest first: released in order.
            stale = 0
            while stale < len(idle) and now - idle[stale].idle_since >= self._keepalive:
                stale += 1
            for conn in idle[:stale]:
                conn.on_lost = None
                conn.close()
            if stale == len(idle):
                del self._idle[key]
            elif stale:
                del idle[:stale]

    def _lost(self, conn: Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.on_lost = None
                conn.close()
        self._idle.clear()


@lru_cache(maxsize=1024)
def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _send(conn: Connection, data: list[bytes], bodiless: bool) -> None:
    if conn.closed:
        raise UpstreamConnectionError("the endpoint closed the connection")
    conn.send(data, bodiless)
    try:
        await conn.head()
    except BaseException:
        conn.close()
        raise


def _head(method: str, target: _Target, headers: Sequence[tuple[str, str]], body: bytes) -> bytes:
    lines = [method, " ", target.path, " HTTP/1.1\r\nHost: ", target.host_header, "\r\n"]
    for name, value in headers:
        lines += (name, ": ", value, "\r\n")
    if body or method in ("POST", "PUT", "PATCH"):
        lines += ("Content-Length: ", str(len(body)), "\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
