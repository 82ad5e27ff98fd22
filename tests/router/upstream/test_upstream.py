"""The upstream client against scripted HTTP/1.1 servers on loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from router.upstream.client import (
    STALE_CLOSE_S,
    UPSTREAM_ERRORS,
    ResponseTooLargeError,
    UpstreamClient,
    UpstreamConnectionError,
    UpstreamProtocolError,
)
from router.upstream.connection import HIGH_WATER_BYTES, WRITE_SLICE_BYTES
from tests.manual_clock import ManualClock


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


Answer = Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serve(answer: Answer) -> AsyncIterator[Server]:
    state = Server()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await answer(state, reader, writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body), body
    )


def answer_once(raw: bytes, hold_open: bool = False) -> Answer:
    """A server that answers one request with ``raw`` bytes, then hangs up, or with
    ``hold_open`` waits until the client does."""

    async def answer(state: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(raw)
        await writer.drain()
        if hold_open:
            await reader.read()

    return answer


async def keep_answering(state: Server, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
    for _ in range(100):
        state.requests.append(await read_request(reader))
        writer.write(ok(b"pong %d" % len(state.requests)))
        await writer.drain()


async def test_requests_reuse_one_kept_alive_connection() -> None:
    client = UpstreamClient(8, 2)
    async with serve(keep_answering) as server:
        for n in (1, 2, 3):
            reply = await client.post(f"{server.url}/v1/x?a=1", [("x-k", "v")], b"ping")
            assert reply.status == 200 and reply.content_type == "text/plain"
            assert await reply.read_all() == b"pong %d" % n
            reply.close()
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nx-k: v\r\n" in first and b"\r\nContent-Length: 4\r\n" in first
        assert first.endswith(b"\r\n\r\nping")
    await client.aclose()


async def test_the_host_header_carries_no_credentials_from_the_endpoint_url() -> None:
    """``Host`` is the URL's host and port (RFC 9110 7.2): a URL's ``user:password@`` went
    into it whole, handing the endpoint (and its access logs) the credentials."""
    client = UpstreamClient(8, 2)
    async with serve(keep_answering) as server:
        url = server.url.replace("http://", "http://user:secret@")
        reply = await asyncio.wait_for(client.request("GET", f"{url}/v1/models", []), 2)
        await reply.read_all()
        reply.close()
        port = server.url.rsplit(":", 1)[1]
        assert server.requests[0].startswith(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:%s\r\n" % port.encode()
        )
        assert b"secret" not in server.requests[0]
    await client.aclose()


async def test_a_large_body_is_written_a_slice_at_a_time_and_arrives_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each write hands the transport one slice, once its buffer has room again: no 30 MB
    join and copy in one turn of the event loop; the bytes arrive unchanged, and the
    connection is reused for the next request."""
    writes: list[int] = []
    write = asyncio.selector_events._SelectorSocketTransport.write

    def spy(transport: Any, data: Any) -> None:
        writes.append(len(data))
        write(transport, data)

    monkeypatch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", spy)
    body = bytes(range(256)) * (4 * WRITE_SLICE_BYTES // 256 + 3)
    client = UpstreamClient(8, 2)
    async with serve(keep_answering) as server:
        for expected in (b"pong 1", b"pong 2"):
            reply = await client.post(f"{server.url}/v1/x", [], body)
            assert await reply.read_all() == expected
            reply.close()
        assert server.connections == 1
        assert all(request.endswith(b"\r\n\r\n" + body) for request in server.requests)
    await client.aclose()
    assert max(writes) <= WRITE_SLICE_BYTES and sum(writes) > 2 * len(body)


async def test_fetch_reads_whole_answers_on_one_kept_alive_connection() -> None:
    client = UpstreamClient(8, 2)
    async with serve(keep_answering) as server:
        for n in (1, 2):
            got = await client.fetch("GET", f"{server.url}/metrics", [("x-k", "v")], seconds=5)
            assert (got.status, got.body) == (200, b"pong %d" % n)
        assert server.connections == 1
        assert server.requests[0].startswith(b"GET /metrics HTTP/1.1\r\n")
        assert b"Content-Length" not in server.requests[0], "a GET without a body has none"
    await client.aclose()


async def test_fetch_past_its_limit_is_an_upstream_error() -> None:
    client = UpstreamClient(8, 2)
    async with serve(keep_answering) as server:
        with pytest.raises(ResponseTooLargeError) as info:
            await client.fetch("GET", f"{server.url}/metrics", seconds=5, limit=4)
        assert isinstance(info.value, UPSTREAM_ERRORS)
        exact = await client.fetch("GET", f"{server.url}/metrics", seconds=5, limit=6)
        assert exact.body == b"pong 2"
    await client.aclose()


async def test_fetch_gives_up_at_its_deadline_and_frees_its_slot() -> None:
    never = asyncio.Event()

    async def silent(state: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await never.wait()  # reads the request, never answers

    client = UpstreamClient(1, 2)
    async with serve(silent) as server:
        with pytest.raises(TimeoutError):
            await client.fetch("GET", f"{server.url}/health", seconds=0.05)
        with pytest.raises(TimeoutError):  # the one slot was given back: it times out again
            await client.fetch("GET", f"{server.url}/health", seconds=0.05)
        assert server.connections == 2, "a timed-out connection is not reused"
    await client.aclose()


async def test_a_stream_arrives_piece_by_piece_before_its_end() -> None:
    release = asyncio.Event()

    async def chunked(state: Server, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection open: the end comes from the chunking

    client = UpstreamClient(8, 2)
    async with serve(chunked) as server:
        reply = await client.post(server.url + "/s", [], b"{}")
        assert await asyncio.wait_for(reply.next_chunk(), 2) == b"first"
        release.set()
        assert await asyncio.wait_for(reply.next_chunk(), 2) == b"second"
        assert await asyncio.wait_for(reply.next_chunk(), 2) == b""
        reply.close()
    await client.aclose()


async def test_a_connection_cut_mid_body_is_an_error_not_an_end() -> None:
    cut = answer_once(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
    client = UpstreamClient(8, 2)
    async with serve(cut) as server:
        reply = await client.post(server.url, [], b"")
        assert await reply.next_chunk() == b"partial"
        with pytest.raises(UpstreamConnectionError):
            await asyncio.wait_for(reply.next_chunk(), 2)
        reply.close()
    await client.aclose()


async def test_a_body_without_length_ends_with_the_connection() -> None:
    unframed = answer_once(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
    client = UpstreamClient(8, 2)
    async with serve(unframed) as server:
        reply = await client.post(server.url, [], b"")
        assert await asyncio.wait_for(reply.read_all(), 2) == b"all of it"
        reply.close()
    await client.aclose()


def hang_up_second(clock: ManualClock, after: float) -> Answer:
    """Answers one request, then reads the next and closes without an answer ``after`` (on
    ``clock``) seconds: as when an idle timeout ends the connection just as the request is
    written (at once), or as when the endpoint read it and then failed (later)."""

    async def answer(state: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        state.requests.append(await read_request(reader))
        writer.write(ok(b"done"))
        await writer.drain()
        if state.connections == 1:
            state.requests.append(await read_request(reader))
            clock.now += after

    return answer


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_request_into_a_reused_connection_that_closes_at_once_goes_again(
    method: str,
) -> None:
    clock = ManualClock()
    client = UpstreamClient(8, 2, clock=clock)
    async with serve(hang_up_second(clock, after=0.0)) as server:
        for _ in range(2):
            reply = await client.request(method, server.url, [], b"x")
            assert await asyncio.wait_for(reply.read_all(), 2) == b"done"
            reply.close()
        assert server.connections == 2 and len(server.requests) == 3
    await client.aclose()


async def test_a_post_the_endpoint_may_have_read_is_not_sent_twice() -> None:
    """Closed without an answer well after it was written: the endpoint may have read it and
    failed (RFC 9110 9.2.2). The caller's policy decides (the proxy retries on another endpoint
    before the first byte, counted as a failed attempt); a GET goes again."""
    clock = ManualClock()
    client = UpstreamClient(8, 2, clock=clock)
    async with serve(hang_up_second(clock, after=STALE_CLOSE_S + 1)) as server:
        reply = await client.post(server.url, [], b"x")
        assert await asyncio.wait_for(reply.read_all(), 2) == b"done"
        reply.close()
        with pytest.raises(UpstreamConnectionError):
            await asyncio.wait_for(client.post(server.url, [], b"x"), 2)
        assert server.connections == 1 and len(server.requests) == 2
    await client.aclose()


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried() -> None:
    async def hang_up(state: Server, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        state.requests.append(await read_request(reader))

    client = UpstreamClient(8, 2)
    async with serve(hang_up) as server:
        with pytest.raises(UpstreamConnectionError):
            await asyncio.wait_for(client.post(server.url, [], b"x"), 2)
        assert server.connections == 1
    await client.aclose()


async def test_a_connection_idle_past_the_keepalive_is_not_reused() -> None:
    client = UpstreamClient(8, 2, keepalive_seconds=0.05)
    async with serve(keep_answering) as server:
        for pause in (0.0, 0.1):
            await asyncio.sleep(pause)
            reply = await client.post(server.url, [], b"x")
            await reply.read_all()
            reply.close()
        assert server.connections == 2
    await client.aclose()


async def test_closing_a_reply_before_its_end_drops_the_connection() -> None:
    hung_up = asyncio.Event()

    async def endless(state: Server, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        if not await reader.read():  # EOF: the gateway hung up, the replica aborts
            hung_up.set()

    client = UpstreamClient(8, 2)
    async with serve(endless) as server:
        reply = await client.post(server.url, [], b"")
        assert await reply.next_chunk() == b"a"
        reply.close()
        await asyncio.wait_for(hung_up.wait(), 2)
        reply.close()  # twice is harmless
    await client.aclose()


async def test_garbage_is_a_protocol_error() -> None:
    garbage = answer_once(b"SMTP ready\r\n\r\n", hold_open=True)
    client = UpstreamClient(8, 2)
    async with serve(garbage) as server:
        with pytest.raises(UpstreamProtocolError) as info:
            await asyncio.wait_for(client.post(server.url, [], b""), 2)
    assert isinstance(info.value, UPSTREAM_ERRORS)
    await client.aclose()


async def test_a_refused_connection_is_an_upstream_error_and_frees_its_slot() -> None:
    async with serve(keep_answering) as server:
        url = server.url
    client = UpstreamClient(1, 2)
    for _ in range(2):  # the one slot comes back after each failure
        with pytest.raises(UPSTREAM_ERRORS):
            await asyncio.wait_for(client.post(url, [], b""), 2)
    await client.aclose()


async def test_max_connections_holds_back_the_next_request_until_one_is_done() -> None:
    client = UpstreamClient(1, 2)
    async with serve(keep_answering) as server:
        first = await client.post(server.url, [], b"1")
        second = asyncio.create_task(client.post(server.url, [], b"2"))
        # Only a client that let the second request through can fail this, never a slow
        # machine (a slow one at worst misses that bug on this run); the server would have
        # seen a second connection.
        await asyncio.sleep(0.1)
        assert not second.done() and server.connections == 1
        await first.read_all()
        first.close()
        reply = await asyncio.wait_for(second, 2)
        assert await reply.read_all() == b"pong 2"
        reply.close()
    await client.aclose()


def recorded_transports(monkeypatch: pytest.MonkeyPatch) -> list[asyncio.Transport]:
    """The transports of the connections the running loop makes from here on."""
    loop = asyncio.get_running_loop()
    transports: list[asyncio.Transport] = []
    connect = loop.create_connection

    async def recording(*args: Any, **kwargs: Any) -> Any:
        transport, protocol = await connect(*args, **kwargs)
        transports.append(transport)
        return transport, protocol

    monkeypatch.setattr(loop, "create_connection", recording)
    return transports


async def test_a_slow_reader_stops_the_socket_being_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = 4 * HIGH_WATER_BYTES
    transports = recorded_transports(monkeypatch)
    big = answer_once(ok(b"x" * size), hold_open=True)
    client = UpstreamClient(8, 2)
    async with serve(big) as server:
        reply = await client.post(server.url, [], b"")
        # The gateway stops reading once more than the high-water mark is buffered; wait for
        # that, however slowly the bytes come (a fixed sleep was too short on a loaded machine).
        assert await until(lambda: not transports[0].is_reading(), 10), "never paused"
        first = await reply.next_chunk()
        assert HIGH_WATER_BYTES < len(first) < size
        assert len(first) + len(await reply.read_all(size)) == size
        reply.close()
    await client.aclose()


async def until(predicate: Callable[[], bool], seconds: float) -> bool:
    """Poll ``predicate`` until it holds; False after ``seconds`` (a bound far above need)."""
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def test_a_connection_whose_whole_answer_paused_its_reading_is_not_pooled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, rest = HIGH_WATER_BYTES * 3 // 4, HIGH_WATER_BYTES // 2  # together past the mark
    transports = recorded_transports(monkeypatch)

    async def in_two_writes(state: Server, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (first + rest))
            writer.write(b"x" * first)
            await writer.drain()
            writer.write(b"y" * rest)
            await writer.drain()

    client = UpstreamClient(8, 2)
    async with serve(in_two_writes) as server:
        reply = await client.post(server.url, [], b"")
        # The whole answer arrives and nobody reads it (the client left): reading pauses.
        assert await until(lambda: not transports[0].is_reading(), 10), "never paused"
        reply.close()
        second = await asyncio.wait_for(client.post(server.url, [], b""), 10)
        assert len(await second.read_all(first + rest)) == first + rest
        second.close()
    await client.aclose()


async def test_an_interim_answer_is_not_taken_for_the_final_one() -> None:
    """A 1xx (100 Continue, 103 Early Hints) is a whole message to llhttp: taken for the
    answer, it would hand the real one to the next request on the pooled connection."""

    async def interim_first(state: Server, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        while True:
            state.requests.append(await read_request(reader))
            if len(state.requests) == 1:
                writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # in a segment of its own, as a proxy would send it
            writer.write(ok(b"answer %d" % len(state.requests)))
            await writer.drain()

    client = UpstreamClient(8, 2)
    async with serve(interim_first) as server:
        for n in (1, 2):
            reply = await asyncio.wait_for(client.post(server.url, [], b"x"), 2)
            assert reply.status == 200
            assert await asyncio.wait_for(reply.read_all(), 2) == b"answer %d" % n
            assert (b"link", b"</a>; rel=preload") not in reply.raw_headers
            reply.close()
    await client.aclose()


async def test_a_cut_body_in_capitalised_chunked_coding_is_an_error() -> None:
    cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n"
    client = UpstreamClient(8, 2)
    async with serve(answer_once(cut)) as server:
        reply = await asyncio.wait_for(client.post(server.url, [], b"x"), 2)
        with pytest.raises(UPSTREAM_ERRORS):
            await asyncio.wait_for(reply.read_all(), 2)
        reply.close()
    await client.aclose()


async def test_a_body_framed_by_the_close_and_cut_by_a_reset_is_an_error() -> None:
    async def reset(state: Server, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"partial":')
        await writer.drain()
        await asyncio.sleep(0.05)  # the head and part of the body read first
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # linger 0: a reset, not a close

    client = UpstreamClient(8, 2)
    async with serve(reset) as server:
        reply = await asyncio.wait_for(client.post(server.url, [], b"x"), 2)
        with pytest.raises(UPSTREAM_ERRORS):
            await asyncio.wait_for(reply.read_all(), 2)
        reply.close()
    await client.aclose()


async def test_an_endpoint_that_holds_all_its_slots_leaves_the_others_theirs() -> None:
    seen = asyncio.Event()

    async def hang(state: Server, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
        state.requests.append(await read_request(reader))
        if len(state.requests) == 2:
            seen.set()
        await reader.read()  # never answers

    client = UpstreamClient(2, 2)
    async with serve(hang) as hung, serve(answer_once(ok(b"here"))) as healthy:
        stuck = [asyncio.create_task(client.post(hung.url, [], b"x")) for _ in range(2)]
        await asyncio.wait_for(seen.wait(), 2)
        reply = await asyncio.wait_for(client.post(healthy.url, [], b"x"), 2)
        assert await asyncio.wait_for(reply.read_all(), 2) == b"here"
        reply.close()
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        assert not client._slots, "no slots kept for endpoints nobody sends to"
    await client.aclose()


async def test_connections_idle_past_the_keepalive_are_closed_though_nothing_asks_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled connection is checked for staleness only when its endpoint is asked again;
    an endpoint never asked again (gone without closing its connections) kept them, and
    their sockets, for the life of the gateway. Releasing any connection sweeps them."""
    clock = ManualClock()
    transports = recorded_transports(monkeypatch)
    client = UpstreamClient(8, 2, keepalive_seconds=4.0, clock=clock)
    async with serve(keep_answering) as gone, serve(keep_answering) as alive:
        reply = await client.request("GET", gone.url, [])
        assert (await asyncio.wait_for(reply.read_all(), 2)).startswith(b"pong")
        reply.close()
        clock.now += 3.0
        reply = await client.request("GET", alive.url, [])
        assert (await asyncio.wait_for(reply.read_all(), 2)).startswith(b"pong")
        reply.close()
        assert not transports[0].is_closing(), "not idle past the keep-alive yet"
        clock.now += 1.5
        reply = await client.request("GET", alive.url, [])
        assert (await asyncio.wait_for(reply.read_all(), 2)).startswith(b"pong")
        reply.close()
        assert transports[0].is_closing(), "the vanished endpoint's connection is still pooled"
        assert not transports[1].is_closing(), "the live endpoint's connection was reused"
        assert alive.connections == 1 and len(alive.requests) == 2
    await client.aclose()
