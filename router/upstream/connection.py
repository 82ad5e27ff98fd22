"""One HTTP/1.1 connection to an endpoint: the transport side of the upstream client.

An ``asyncio.Protocol`` fed straight by the event loop, with httptools (llhttp, the parser
uvicorn serves with) decoding the response: no stream reader, no per-chunk task or buffer
copy between the socket and the relay. A connection carries one request at a time; the pool in
``router.upstream.client`` hands it out and takes it back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

# Read no further while this much of a body waits for the relay: a client that reads slowly
# then holds back the replica through TCP, instead of the gateway buffering its answer.
HIGH_WATER_BYTES = 256 * 1024
# A request larger than this is written a slice at a time, as the socket takes it: Python
# 3.11's transports join and then copy whatever is written at once (40 ms for a 30 MB body).
WRITE_SLICE_BYTES = 256 * 1024


class UpstreamConnectionError(ConnectionError):
    """The endpoint closed the connection before its response ended."""


class UpstreamProtocolError(ConnectionError):
    """The endpoint's answer is not valid HTTP/1.1."""


class Connection(asyncio.Protocol):
    """A response is read as it arrives: its head first, then its body piece by piece."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._interim = False  # between an interim (1xx) head and its message's end
        self._bodiless = False  # the answer to a HEAD: its head is all of it
        self._framed = False
        self._complete = self._keep_alive = False
        self._error: BaseException | None = None
        self.closed = False
        self._unsent: deque[memoryview] = deque()  # slices of a large request to write
        self._write_paused = False
        # Bytes of a response arrived since the request was written: a reused connection that
        # fails before any did was probably closed by the endpoint while idle, and an
        # idempotent request goes again on a new one (router/upstream/client.py).
        self.answered = False
        self.requests = 0
        self.key: tuple[str, int, bool] = ("", 0, False)  # (host, port, tls) it was dialled to
        self.idle_since = 0.0
        self.on_lost: Callable[[Connection], None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"invalid response: {exc}"))
            self.close()
            return
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._write_more()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._unsent.clear()
        if self.requests and not self._complete:
            if self._head_done and not self._framed and self._error is None and exc is None:
                # A body without length or chunks ends with the connection: a clean close
                # (a reset says it was cut).
                self._complete = True
            else:
                cause = exc or UpstreamConnectionError("the endpoint closed the connection")
                if not isinstance(cause, OSError):
                    cause = UpstreamConnectionError(repr(cause))
                self._fail(cause)
        self._wake()
        if self.on_lost is not None:
            self.on_lost(self)

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_done:  # a chunked body's trailers are not relayed
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if 100 <= self.status < 200:
            # An interim answer (100 Continue, 103 Early Hints): the final one follows on the
            # same connection. llhttp reports it as a whole message (see on_message_complete).
            self._interim = True
            self.headers = []
            return
        self._head_done = True
        for name, value in self.headers:
            low = name.lower()
            if low == b"content-length" or (
                low == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                self._framed = True
        if self._bodiless:
            # Its Content-Length or chunking describe the body a GET would get: none comes.
            # llhttp cannot be told so and would wait for that body, so unless it saw the
            # message end (a length of 0) the connection is not used again (_keep_alive).
            self._complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        # llhttp answers this only while the message is current, not once it has ended.
        self._keep_alive = bool(self._parser.should_keep_alive())
        self._complete = True
        self._wake()

    # the client's side

    @property
    def status(self) -> int:
        return int(self._parser.get_status_code())

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def drained(self) -> bool:
        """The whole body arrived and was taken: the next chunk would be the end."""
        return self._complete and not self._chunks

    @property
    def reusable(self) -> bool:
        # A paused one (its answer left unread past the high-water mark) would never read the
        # next answer: only next_chunk resumes reading.
        return (
            self._complete and self._keep_alive and not self.closed and not self._unsent
            and not self._paused
        )

    def send(self, data: list[bytes], bodiless: bool = False) -> None:
        """Write a request; its response state starts afresh. ``bodiless``: the request is a
        HEAD, whose answer has no body whatever its head says."""
        assert self.transport is not None
        self.requests += 1
        self.answered = False
        self._bodiless = bodiless
        self.headers = []
        self._head_done = self._framed = self._complete = self._keep_alive = False
        self._interim = False
        self._chunks.clear()
        self._buffered = 0
        if len(data[-1]) <= WRITE_SLICE_BYTES:
            self.transport.writelines(data)
            return
        step = WRITE_SLICE_BYTES
        for part in data:
            view = memoryview(part)
            self._unsent.extend(view[i : i + step] for i in range(0, len(view), step))
        self._write_more()

    def _write_more(self) -> None:
        """Write slices of the request until the transport's buffer is full (it says so
        through pause_writing; resume_writing carries on)."""
        while self._unsent and not self._write_paused and not self.closed:
            assert self.transport is not None
            self.transport.write(self._unsent.popleft())

    async def head(self) -> None:
        """Wait for the status line and headers."""
        while not self._head_done:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise UpstreamConnectionError("the endpoint closed the connection")
            await self._wait()

    async def next_chunk(self) -> bytes:
        """All of the body that has arrived, once some has; ``b""`` at its end."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            if self._complete and not self._unsent:
                self.transport.close()
            else:
                # An exchange cut short: dropped at once, with whatever of the request the
                # transport still holds. A graceful close would first wait for those bytes
                # to be written, forever if the endpoint stopped reading (hung), keeping the
                # socket open and the endpoint uninformed.
                self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    async def _wait(self) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
