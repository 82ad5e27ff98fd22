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
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            # Its task was created, not run: no write has happened yet.
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
            callbacks: set[Callable[[], None]] = set()
            cycle.scope[DISCONNECT_CALLBACKS] = callbacks  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is None or cycle.response_complete:
            return
        cycle.scope[DISCONNECTED] = True  # type: ignore[literal-required]
        callbacks: set[Callable[[], None]] = cycle.scope.get(  # type: ignore[assignment]
            DISCONNECT_CALLBACKS, set()
        )
        for callback in list(callbacks):
            callback()
