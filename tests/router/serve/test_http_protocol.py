from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.serve.http_protocol import GatewayHttpProtocol, HeadWithBody
from router.serve.server import bind_socket, uvicorn_config
from tests.router.serve.test_server import _get


class RecordingTransport:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[bytes, ...]]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", (data,)))

    def writelines(self, data: tuple[bytes, ...]) -> None:
        self.calls.append(("writelines", tuple(data)))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def wrapped(transport: RecordingTransport) -> HeadWithBody:
    return HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]


async def test_the_head_leaves_with_the_first_body_part_in_one_call() -> None:
    transport = RecordingTransport()
    head = wrapped(transport)
    head.write(b"HTTP/1.1 200 OK\r\n\r\n")
    head.write(b"body")
    head.write(b"more")
    await asyncio.sleep(0)  # the turn's flush finds nothing held
    assert transport.calls == [
        ("writelines", (b"HTTP/1.1 200 OK\r\n\r\n", b"body")),
        ("write", (b"more",)),
    ]


async def test_a_head_without_a_body_in_the_same_turn_leaves_at_the_turn_end() -> None:
    transport = RecordingTransport()
    head = wrapped(transport)
    head.write(b"head")
    assert transport.calls == []
    await asyncio.sleep(0)
    assert transport.calls == [("write", (b"head",))]
    head.write(b"later")
    assert transport.calls[-1] == ("write", (b"later",))


async def test_closing_writes_what_is_held_first_and_other_calls_reach_the_socket() -> None:
    transport = RecordingTransport()
    head = wrapped(transport)
    head.write(b"head")
    head.close()
    assert transport.calls == [("write", (b"head",))] and transport.closed
    assert head.is_closing()


@contextlib.asynccontextmanager
async def serving(app: Any, keep_alive: float | None = None) -> AsyncIterator[int]:
    sock = bind_socket()
    config = uvicorn_config(
        app, "127.0.0.1", sock.getsockname()[1], log_level="warning",
        **({} if keep_alive is None else {"keep_alive_seconds": keep_alive}),
    )
    assert config.http is GatewayHttpProtocol
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()


async def test_over_a_socket_a_late_body_does_not_hold_back_the_head() -> None:
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await release.wait()  # the client must see the head before any body is sent
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                release.set()
                assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"
        finally:
            writer.close()


@pytest.mark.parametrize("requests", [2])
async def test_over_a_socket_kept_alive_answers_are_whole(requests: int) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = scope["path"].encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async with asyncio.timeout(10):
                for n in range(requests):
                    writer.write(f"GET /r{n} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert b"content-length: 3" in head
                    assert await reader.readexactly(3) == f"/r{n}".encode()
        finally:
            writer.close()


def waiting_app(
    seen: dict[str, object], waiting: asyncio.Event, ended: asyncio.Event, read_body: bool = False
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An app whose request waits for a first byte that never comes, under a DisconnectWatch:
    ``seen`` gets its callbacks, its watch task and whether the cancel was the watch's."""
    from router.api.streaming import DISCONNECT_CALLBACKS, DisconnectWatch

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if read_body:
            await receive()  # the body, as the gateway reads it (reading resumes)
        watch = DisconnectWatch(receive, scope)
        watch.start()
        seen["callbacks"] = scope.get(DISCONNECT_CALLBACKS)
        seen["task"] = watch._watcher
        try:
            waiting.set()
            await asyncio.Event().wait()  # a request waiting for its first byte
        except asyncio.CancelledError:
            seen["absorbed"] = watch.absorb_cancel()
            ended.set()
        finally:
            watch.stop()

    return app


async def test_over_a_socket_a_client_that_leaves_cancels_the_request_without_a_task() -> None:
    waiting, ended = asyncio.Event(), asyncio.Event()
    seen: dict[str, object] = {}
    async with serving(waiting_app(seen, waiting, ended)) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(10):
            await waiting.wait()
            writer.close()
            await ended.wait()
    assert seen["task"] is None and seen["absorbed"] is True
    assert seen["callbacks"] == set()  # the watch took its callback back


async def test_over_a_socket_a_client_that_leaves_with_a_pipelined_request_cancels_the_running_one(
) -> None:
    """Two requests in one write: the second waits its turn (uvicorn's pipeline) and is the
    protocol's latest cycle; the client leaving must still cancel the first, the one running."""
    waiting, ended = asyncio.Event(), asyncio.Event()
    seen: dict[str, object] = {}
    async with serving(waiting_app(seen, waiting, ended, read_body=True)) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
        writer.write(request + request.replace(b"/a", b"/b"))
        async with asyncio.timeout(5):
            await waiting.wait()
            writer.close()
            await ended.wait()
    assert seen["absorbed"] is True


async def test_over_a_socket_a_refused_expect_100_continue_body_does_not_swallow_the_next_request(
) -> None:
    """A body refused on its Content-Length alone (read_body's early 413) is never asked for:
    a client that sent ``Expect: 100-continue`` gets no 100 and sends no body. The connection
    must not then read the client's next request as that body: it closes, or answers it."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        status = 413 if scope["path"] == "/big" else 200
        body = b"{}"
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n"
                b"expect: 100-continue\r\n\r\n"
            )
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 413")
                assert await reader.readexactly(2) == b"{}"
                writer.write(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
                rest = await reader.read(1 << 16)
            assert rest == b"" or rest.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()


async def test_over_a_socket_a_request_answered_before_its_body_ends_closes_the_connection(
) -> None:
    """A 408 on a slow body (or a 413 on a long one) is the answer: the rest of the body is
    read by nobody, and a connection kept for it is held for as long as the client likes."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()  # the first part only, then give up on the rest
        await send({"type": "http.response.start", "status": 408,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n{\"a\"")
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 408")
                assert await reader.readexactly(2) == b"{}"
                assert await reader.read(1 << 16) == b""  # closed: no wait for the rest
        finally:
            writer.close()


async def test_over_a_socket_a_request_head_past_the_limit_is_refused_with_431_and_closed(
) -> None:
    """The parser keeps whatever head a client sends: without a limit, one connection streaming
    header lines that never end grows the worker's memory until it is killed."""
    from router.serve.http_protocol import MAX_HEAD_BYTES

    reached: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    line = b"x-filler: " + b"a" * 1000 + b"\r\n"
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /big HTTP/1.1\r\nhost: x\r\n")
            with contextlib.suppress(ConnectionError):
                for _ in range(MAX_HEAD_BYTES // len(line) + 2):  # never the blank line
                    writer.write(line)
                    await writer.drain()
            async with asyncio.timeout(5):
                answer = await reader.read()  # to the end: the connection closes
        finally:
            writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"connection: close" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert reached == []


async def test_over_a_socket_a_head_within_the_limit_and_a_large_body_are_served() -> None:
    """The limit is on the head alone: a big body in the same segments as a head is not."""
    from router.serve.http_protocol import MAX_HEAD_BYTES

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    headers = b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 900) for i in range(MAX_HEAD_BYTES // 1000))
    body = b"b" * (4 * MAX_HEAD_BYTES)
    request = (b"POST / HTTP/1.1\r\nhost: x\r\n" + headers
               + b"content-length: %d\r\n\r\n" % len(body) + body)
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request + request)  # the second one pipelined behind the first
            async with asyncio.timeout(5):
                for _ in range(2):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    assert await reader.readexactly(length) == str(len(body)).encode()
        finally:
            writer.close()


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nhost: x\r\n"])
async def test_over_a_socket_a_connection_that_never_completes_a_head_is_closed(
    sent: bytes,
) -> None:
    """uvicorn times out a kept-alive connection between requests only: one that sends nothing,
    or a head a byte at a time (slowloris), would hold its socket and file descriptor for good.
    It gets the keep-alive timeout (made short here) to complete a head."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("no request reaches the app")

    async with serving(app, keep_alive=0.05) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(sent)
            async with asyncio.timeout(5):
                assert await reader.read() == b""  # closed
        finally:
            writer.close()


def _answer_after(delay: float) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(delay)
        head = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def test_an_idle_kept_alive_connection_is_closed_after_the_configured_keep_alive() -> None:
    """The keep-alive is the server's setting (``uvicorn_config``'s), not uvicorn's fixed 30 s:
    an idle connection is closed by the server once it is up (a tiny one here, so the wait is
    short)."""
    async with serving(_answer_after(0.0), keep_alive=0.05) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert b"connection: close" not in await _get(reader, writer, "/")  # kept alive
        assert await reader.read() == b"", "closed by the server once idle"
        writer.close()


async def test_a_request_outlasting_the_keep_alive_is_answered_whole() -> None:
    """The keep-alive bounds the wait for a head and the idle time between requests, never a
    request being answered: an agent's streamed answer takes minutes. The timer armed at the
    connection's start (or at the previous answer's end) stops once a head is whole; it used
    to run on and cut every answer 30 s after it, first request or kept-alive alike. Here
    each answer takes four keep-alive times (the timer fires on the same loop first)."""
    keep_alive = 0.05
    async with serving(_answer_after(4 * keep_alive), keep_alive=keep_alive) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert b" 200 " in await _get(reader, writer, "/first")  # on a new connection
        assert b" 200 " in await _get(reader, writer, "/second")  # on the kept-alive one
        writer.close()
