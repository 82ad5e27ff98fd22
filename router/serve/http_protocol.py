"""uvicorn's httptools protocol, with a response's head and first body part in one write.

uvicorn writes the status line and headers when the app sends ``http.response.start``, and
the body when it sends ``http.response.body``: two system calls and two TCP segments for an
answer the gateway holds whole (a non-streamed completion, or a stream's first chunk). Here
the head waits for the first body write and both leave in one ``writelines`` (one ``writev``).
It waits one loop turn at most, so a response whose body comes later still gets its head out
at once. It also bounds a request's head: ``MAX_HEAD_BYTES`` (431 past it), and the keep-alive
timeout to arrive whole.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.api.streaming import DISCONNECT_CALLBACKS, DISCONNECTED
from router.core.errors import BadRequestError

# The request line and headers of one request, as Envoy's default (60 KiB) give or take: the
# parser keeps whatever head a client sends, so without a limit one connection streaming header
# lines grows the worker's memory until it is killed.
MAX_HEAD_BYTES = 64 * 1024


class HeadWithBody:
    """A response's transport: holds the first write (the head) until the next one or the end
    of the loop turn, whichever comes first; everything else goes to ``transport``."""

    __slots__ = ("_held", "_loop", "_transport", "_waiting")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._waiting = True  # for the first write
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif self._waiting:
            self._waiting = False
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # is_closing, get_extra_info, pause_reading...: the socket's own.
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """Each request's cycle writes through a :class:`HeadWithBody`, and its scope carries the
    callbacks to call when the client leaves before the response ends (DisconnectWatch)."""

    # The cycle whose task runs: with pipelined requests not ``self.cycle`` (the latest
    # parsed, still queued), and the one a client leaving must cancel.
    _running: RequestResponseCycle | None = None
    # Bytes received while a request's head is incomplete (request line and headers).
    _head_bytes = 0
    _in_head = False

    # uvicorn's keep-alive timer runs between requests only, and the first byte of a head
    # stops it: a connection that sends nothing, or a head a byte at a time (slowloris), would
    # hold its socket for good. Armed from the connection's start too and left running until a
    # head is complete, it gives each head the keep-alive timeout to arrive whole.
    _keep_timer = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def _unset_keepalive_if_required(self) -> None:
        if self._keep_timer:  # data_received's call, before the parser has seen a whole head
            self._keep_timer = False
            return
        super()._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head
        self._keep_timer = True
        super().data_received(data)
        self._keep_timer = False
        if not self._in_head or self.transport.is_closing():
            self._head_bytes = 0
            return
        # A head begun in this segment counts the whole segment: it may include the end of the
        # previous request's body, which only makes a pipelining client's limit a bit smaller.
        self._head_bytes = (self._head_bytes if was_in_head else 0) + len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    def _refuse_head(self) -> None:
        """431 and close; the parser's state is past saving. A client still waiting for an
        earlier pipelined answer gets no 431 in the middle of it, only the close."""
        running = self._running
        if running is None or running.response_complete:
            error = BadRequestError(
                f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
                code="request_header_fields_too_large",
            )
            body = error.body()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_headers_complete(self) -> None:
        self._in_head = False
        # The head is whole: the keep-alive timer (armed at the connection's start or at the
        # last answer's end, and left running by data_received) has done its job. Left on, it
        # would close the connection under the answer.
        HttpToolsProtocol._unset_keepalive_if_required(self)
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            # Its task was created, not run: no write has happened yet.
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
            callbacks: set[Callable[[], None]] = set()
            cycle.scope[DISCONNECT_CALLBACKS] = callbacks  # type: ignore[literal-required]
            cycle.on_response = functools.partial(self._after_response, cycle)

    def _after_response(self, cycle: RequestResponseCycle) -> None:
        """A request answered before its body came in (a 413 on its Content-Length, a 408 on
        a slow body) closes the connection. After ``Expect: 100-continue`` with no 100 sent,
        the parser could not tell that body from the client's next request; otherwise the
        connection would wait, for as long as the client likes, for a body nobody reads."""
        if cycle.more_body:
            cycle.transport.close()
        self.on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self._running
        super().connection_lost(exc)
        if cycle is None or cycle.response_complete:
            return
        if cycle is not self.cycle:  # uvicorn marks only the latest cycle (queued) as left
            cycle.disconnected = True
            cycle.message_event.set()
        cycle.scope[DISCONNECTED] = True  # type: ignore[literal-required]
        callbacks: set[Callable[[], None]] = cycle.scope.get(  # type: ignore[assignment]
            DISCONNECT_CALLBACKS, set()
        )
        for callback in list(callbacks):
            callback()
