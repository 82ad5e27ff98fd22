"""uvicorn's httptools protocol, with a response's head and first body part in one write.

uvicorn writes the status line and headers when the app sends ``http.response.start``, and
the body when it sends ``http.response.body``: two system calls and two TCP segments for an
answer the gateway holds whole (a non-streamed completion, or a stream's first chunk). Here
the head waits for the first body write and both leave in one ``writelines`` (one ``writev``).
It waits one loop turn at most, so a response whose body comes later still gets its head out
at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.api.streaming import DISCONNECT_CALLBACKS, DISCONNECTED


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

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_headers_complete(self) -> None:
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
