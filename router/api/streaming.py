"""Passing an upstream response to the client chunk by chunk, and noticing when it leaves.

Starlette only notices a disconnected client when a write fails, and uvicorn drops writes to a
closed connection silently, so a proxy built on ``StreamingResponse`` keeps the upstream request
(and the replica's batch slot) alive until the answer ends. :class:`DisconnectWatch` instead
listens on the ASGI receive channel for the whole request and cancels the request's task the
moment the client goes, which closes the upstream connection and so aborts the replica's work.

No relay waits forever: each step (the next upstream chunk, and passing it to the client) runs
under the idle timeout, so a silent replica or a client that stopped reading ends the request.
When shutdown's drain deadline cancels a stream, it ends with an error event, not a cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.api.deadlines import Deadlines
from router.core.lease import Lease
from router.protocol.responses_api import FAILED, OPENING, TOKEN
from router.upstream.client import UPSTREAM_ERRORS, UpstreamReply

# Where a server that calls back when a client leaves (the gateway's own HTTP protocol,
# router/serve/http_protocol.py) puts the set of callbacks to call: a watch then needs no task.
DISCONNECT_CALLBACKS = "prefixgate.disconnect_callbacks"
# ... and marks, once the client has left, that it has (for a watch started after that).
DISCONNECTED = "prefixgate.disconnected"


class DisconnectWatch:
    """Cancels the current task when the client disconnects, until :meth:`stop`.

    With the server's callbacks in the scope (``DISCONNECT_CALLBACKS``) it registers one;
    otherwise a task listens on the ASGI receive channel (a task per request: its creation and
    cancellation were a measurable share of a short request's CPU)."""

    def __init__(self, receive: Receive, scope: Scope | None = None) -> None:
        self._receive = receive
        self._owner = asyncio.current_task()
        self._scope = scope
        self._callbacks: set[Callable[[], None]] | None = (
            scope.get(DISCONNECT_CALLBACKS) if scope is not None else None
        )
        self._watcher: asyncio.Task[None] | None = None
        self.disconnected = False

    def start(self) -> None:
        if self._callbacks is not None:
            if self._scope is not None and self._scope.get(DISCONNECTED):
                # Gone already (while its body was parsed, say): the caller checks
                # ``disconnected`` before sending anything (a cancel would land only at the
                # task's next wait, which may be past the send).
                self.disconnected = True
                return
            self._callbacks.add(self._left)
        else:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._left()
                return

    def _left(self) -> None:
        self.disconnected = True
        if self._owner is not None:
            self._owner.cancel()

    def stop(self) -> None:
        # Must run before the last body message: once the response is complete, uvicorn's
        # receive() reports a disconnect at once, which must not cancel the finished request.
        if self._callbacks is not None:
            self._callbacks.discard(self._left)
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        self._watcher = None

    def absorb_cancel(self) -> bool:
        """After a CancelledError: True (and the cancel undone) if it was ours."""
        if not self.disconnected:
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True


def sse_error_event(message: str, error_type: str = "upstream_error", code: int = 502) -> bytes:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


class ErrorEvent(Protocol):
    """Renders a mid-stream error in the API's own SSE shape (Anthropic and the Responses API
    name their events; OpenAI's chat and completions streams do not)."""

    def __call__(self, message: str, error_type: str = ..., code: int = ...) -> bytes: ...


# Where the server's own ``send`` travels in the scope (set by :class:`ServerSend`).
SERVER_SEND = "prefixgate.server_send"


class ServerSend:
    """The outermost ASGI layer: puts the server's own ``send`` in the scope.

    A relayed stream sends one body message per token. The framework's layers in between
    (error handling, exception telemetry, body limits) wrap ``send`` only to see whether the
    response has started, so once the start went through them, body chunks can skip them:
    each wrapper is a coroutine per token, for nothing.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class ClientStalled(Exception):
    """The client did not take a chunk within the idle timeout."""


class UpstreamResponse(Response):
    """Relays an upstream reply whose status line and first chunk were already received."""

    def __init__(
        self,
        upstream: UpstreamReply,
        first_chunk: bytes,
        headers: list[tuple[bytes, bytes]],
        *,
        lease: Lease,
        watch: DisconnectWatch,
        idle_timeout: float,
        deadlines: Deadlines,
        on_finish: Callable[[str], None],
        draining: Callable[[], bool] = lambda: False,
        error_event: ErrorEvent = sse_error_event,
        observe: Callable[[bytes], None] | None = None,
    ) -> None:
        self.status_code = upstream.status
        self.raw_headers = headers
        self.background = None
        self._upstream = upstream
        self._first = first_chunk
        self._lease = lease
        self._watch = watch
        self._idle_timeout = idle_timeout
        self._deadlines = deadlines
        self._on_finish = on_finish
        self._draining = draining
        self._error_event = error_event
        # Sees every chunk before the client does (the Responses API's id -> endpoint memory).
        self._observe = observe
        self._sse = upstream.content_type.startswith("text/event-stream")
        self._started = False
        self._last = first_chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "ok"
        try:
            outcome = await self._relay(send, scope.get(SERVER_SEND, send))
        except ClientStalled:
            # Nothing more can be written to it; uvicorn closes the connection.
            outcome = "client_stalled"
        except asyncio.CancelledError:
            outcome = "cancelled"
            if self._watch.absorb_cancel():
                outcome = "client_disconnect"
            elif self._draining() and self._sse and self._started:
                outcome = "shutdown"
                await self._end_on_shutdown(send)
            else:
                raise
        finally:
            self._watch.stop()
            self._lease.release()
            self._upstream.close()
            self._on_finish(outcome)

    async def _relay(self, send: Send, body_send: Send) -> str:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        self._started = True
        outcome = "ok"
        if self._first:
            if self._observe is not None:
                self._observe(self._first)
            if self._upstream.ended:
                # The whole answer is in: the server writes it and the body's end at once.
                self._watch.stop()
                await self._send_chunk(send, self._first, more=False)
                return outcome
            await self._send_chunk(send, self._first)
            try:
                if await self._pump(body_send):
                    return outcome
            except UPSTREAM_ERRORS as exc:
                if not self._sse:
                    # A JSON body cut short has no way to say so but a cut: the body is left
                    # unended, and the server closes the connection (its length, or the chunks'
                    # missing end, tells the client the answer is incomplete).
                    return "stream_error"
                outcome = "stream_error"
                event = _lead(self._last) + self._error_event(_failure(exc))
                await self._send_chunk(send, event)
        self._watch.stop()
        await self._send_chunk(send, b"", more=False)
        return outcome

    async def _pump(self, send: Send) -> bool:
        """Relay the rest; True when the last chunk went out as the body's end."""
        # One timer for the whole stream rather than one per chunk (a timer per chunk was a
        # measurable share of the gateway's CPU): the deadline moves with each chunk relayed,
        # and covers both sides, the replica producing the next chunk and the client taking it
        # (a client that stopped reading would block send forever).
        idle = self._deadlines.start(self._idle_timeout)
        sending = False
        try:
            while True:
                chunk = await self._upstream.next_chunk()
                if not chunk:
                    return False
                self._last = chunk
                if self._observe is not None:
                    self._observe(chunk)
                last = self._upstream.ended
                if last:  # one write for the last chunk and the end (of a chunked body)
                    self._watch.stop()
                sending = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return True
                sending = False
                idle.touch()
        except asyncio.CancelledError:
            if not idle.absorb_expiry():
                raise
            if sending:
                raise ClientStalled from None
            raise TimeoutError from None
        finally:
            idle.stop()

    async def _send_chunk(self, send: Send, chunk: bytes, more: bool = True) -> None:
        """A send outside the pump, under the idle timeout too: a client that stopped reading
        blocks any send, the body's end included."""
        idle = self._deadlines.start(self._idle_timeout)
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        except asyncio.CancelledError:
            if idle.absorb_expiry():
                raise ClientStalled from None
            raise
        finally:
            idle.stop()

    async def _end_on_shutdown(self, send: Send) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        event = _lead(self._last) + self._error_event(
            "the gateway is shutting down; the stream was cut", "service_unavailable", 503
        )
        self._watch.stop()
        with contextlib.suppress(ClientStalled):  # the connection is closed after it anyway
            await self._send_chunk(send, event)
            await self._send_chunk(send, b"", more=False)


def _lead(last: bytes) -> bytes:
    # Never glue an event to a partial line: close any open event first.
    return b"" if last.endswith(b"\n\n") else b"\n\n"


def _failure(exc: BaseException) -> str:
    reason = "idle timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
    return f"upstream stream failed: {reason}"


def tell_first_byte(lease: Lease, begun: int, answered: bool = True) -> None:
    """Tell the lease its first byte as far as the answer has got (responses_api.answer_begun's
    TOKEN, or FAILED: an error before any token, whose time says nothing of the prefill)."""
    if begun == TOKEN:
        lease.first_byte(answered=answered)
    elif begun == FAILED:
        lease.first_byte(tokens=False, answered=False)


class FirstToken:
    """A chunk tap for a Responses stream, whose first events come before any token: tells
    the lease the first byte at the first chunk past them (``begun``: OPENING, TOKEN or
    FAILED), then hands every chunk to ``then``."""

    __slots__ = ("_begun", "_lease", "_then", "_waiting")

    def __init__(
        self, lease: Lease, begun: Callable[[bytes], int],
        then: Callable[[bytes], None] | None = None,
    ) -> None:
        self._lease, self._begun, self._then = lease, begun, then
        self._waiting = True

    def __call__(self, chunk: bytes) -> None:
        if self._waiting and (state := self._begun(chunk)) != OPENING:
            self._waiting = False
            tell_first_byte(self._lease, state)
        if self._then is not None:
            self._then(chunk)
