"""A Redis server for the tests: ``REDIS_URL``, else 127.0.0.1:6379, else a private one.

The private server is ``redis-server`` on a free port without persistence, started once per test
session and killed at its end. When none can be had the Redis tests skip with the reason, except
under CI (env ``CI`` set), where a missing Redis is a failure: ``.ci/run`` sets CI and provides
one. A start (or a private cluster's forming) gets ``START_TIMEOUT``: generous, since a loaded
2-core machine can take seconds, yet bounded, so a Redis that never comes still ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio

from router.index.redis_link import LuaScript

T = TypeVar("T")
DEFAULT_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT = 30.0


def answers(url: str, timeout: float = 0.5) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def private_server() -> Iterator[str]:
    """``redis-server`` on a free loopback port for as long as the context lasts."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("no REDIS_URL, nothing on 127.0.0.1:6379 and no redis-server binary")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory(prefix="prefixgate-redis-") as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", workdir]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not answers(url, 0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start")
                time.sleep(0.05)
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def redis_server_url() -> Iterator[str]:
    """Yield a Redis URL for the session; skip (or fail under CI) when there is none."""
    url = os.environ.get("REDIS_URL")
    if url:
        if not answers(url):
            unavailable(f"REDIS_URL={url} does not answer PING")
        yield url
        return
    if answers(DEFAULT_URL):
        yield DEFAULT_URL
        return
    with started(private_server) as url:
        yield url


@contextlib.contextmanager
def started(server: Callable[[], contextlib.AbstractContextManager[T]]) -> Iterator[T]:
    """A private ``server`` (its URL) while it runs; skip (or fail under CI) if it cannot."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(server())
        except RuntimeError as exc:
            unavailable(str(exc))
        yield url


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"Redis needed under CI: {reason}", pytrace=False)
    pytest.skip(f"Redis tests need a Redis server: {reason}")


def unique_namespace() -> str:
    return "t" + uuid.uuid4().hex[:16]


async def delete_namespace(url: str, namespace: str) -> None:
    """Remove every key a test made under ``namespace`` (its id is unique, so the glob is safe)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"*pg:{namespace}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def namespace_for(url: str) -> AsyncIterator[str]:
    namespace = unique_namespace()
    try:
        yield namespace
    finally:
        await delete_namespace(url, namespace)


# Prepended to a script by declared_keys_only: every key a command names must be one of KEYS
# (the first argument of every command the scripts use, TIME aside, is its key; RENAME, DEL and
# EXISTS take keys only).
_DECLARED_KEYS_ONLY = """
local declared_keys_ = {}
for _, k in ipairs(KEYS) do declared_keys_[k] = true end
local function checked_call_(cmd, key, ...)
  if cmd == 'TIME' then return redis.call(cmd) end
  if not declared_keys_[key] then error('key not given in KEYS: ' .. tostring(key)) end
  if cmd == 'RENAME' or cmd == 'DEL' or cmd == 'EXISTS' then  -- every argument a key
    for _, k in ipairs({...}) do
      if not declared_keys_[k] then error('key not given in KEYS: ' .. tostring(k)) end
    end
  end
  return redis.call(cmd, key, ...)
end
"""


def declared_keys_only(script: LuaScript) -> LuaScript:
    """``script`` failing on any key it touches that it was not given in KEYS: a Redis
    Cluster (or a proxy) routes a script by its declared keys, and a key built inside it
    escapes that, even when it shares their hash tag."""
    return LuaScript(_DECLARED_KEYS_ONLY + script.source.replace("redis.call(", "checked_call_("))


class FlakyProxy:
    """A TCP proxy to Redis that can turn into a black hole: accepts, reads, never answers."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 6379
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def forwarding(self) -> bool:
        return self._open.is_set()

    @forwarding.setter
    def forwarding(self, value: bool) -> None:
        if value:
            self._open.set()
        else:
            self._open.clear()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if not self.forwarding:
            while await reader.read(65536):
                pass
            return
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers.add(up_writer)
        pumps = [self._pump(reader, up_writer), self._pump(up_reader, writer)]
        await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._open.wait()  # hold the bytes meanwhile: Redis looks hung
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
