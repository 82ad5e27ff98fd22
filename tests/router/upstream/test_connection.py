"""The upstream connection's life: when an answer ends, and how a connection is let go
(router/upstream/connection.py), on loopback sockets."""

from __future__ import annotations

import asyncio

import pytest

from router.upstream.client import UpstreamClient
from tests.router.upstream.test_upstream import (
    Server,
    ok,
    read_request,
    recorded_transports,
    serve,
    until,
)

# What a server answers to a HEAD: the head a GET would get, without its body (RFC 9110 9.3.2).
HEAD_ANSWERS = {
    "length": b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1234\r\n\r\n",
    "chunked": b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n",
    "empty": b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
}


@pytest.mark.parametrize("framing", sorted(HEAD_ANSWERS))
async def test_the_answer_to_a_head_request_ends_with_its_head(framing: str) -> None:
    """A HEAD's answer has no body whatever its Content-Length or Transfer-Encoding say:
    read as if it had one, it never ends (the request waits out its timeout), and the next
    request on the connection would get the rest of the bytes the parser awaits."""

    async def answer(state: Server, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            state.requests.append(request)
            if request.startswith(b"HEAD "):
                writer.write(HEAD_ANSWERS[framing])
            else:
                writer.write(ok(b"got %d" % len(state.requests)))
            await writer.drain()

    client = UpstreamClient(8, 2)
    async with serve(answer) as server:
        reply = await asyncio.wait_for(client.request("HEAD", f"{server.url}/x", []), 10)
        assert reply.status == 200
        assert await asyncio.wait_for(reply.read_all(), 10) == b""
        assert reply.ended
        reply.close()
        got = await client.fetch("GET", f"{server.url}/x", seconds=10)
        assert (got.status, got.body) == (200, b"got 2")
        # Only an answer whose end the parser saw leaves the connection fit to reuse.
        assert server.connections == (1 if framing == "empty" else 2)
    await client.aclose()


async def test_a_request_given_up_while_the_endpoint_reads_nothing_lets_go_of_its_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica that stopped reading (hung, but its kernel still holds the connection) and a
    request given up on (first-byte timeout, client gone) with part of a large body still
    waiting in the transport: dropping the connection must drop it, not wait for a flush that
    never comes (a socket and up to a write slice of buffered bytes held per such request,
    and the replica not told)."""
    transports = recorded_transports(monkeypatch)
    stop = asyncio.Event()

    async def stalled(state: Server, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the head; the body is never read
        await stop.wait()

    # Past what the kernel's socket buffers take, so that some stays in the transport.
    body = b"x" * (32 << 20)
    client = UpstreamClient(8, 2)
    async with serve(stalled) as server:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.post(server.url, [], body), 0.5)
        sock = transports[0].get_extra_info("socket")
        assert await until(lambda: sock.fileno() == -1, 10), "the socket is still open"
        stop.set()
    await client.aclose()
