"""ASGI responses of the simulated server: JSON, errors, and generation (stream or not).

``GenerationResponse`` runs one request through the engine and watches the connection while
it waits: a client that disconnects, before or after the first token, streaming or not,
aborts its request in the engine at once (blocks freed, running gauge drops).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import protocol as p
from .engine import Engine
from .request import SimRequest, Status

JSON = "application/json"


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=JSON)


def error_response(err: p.ApiError) -> Response:
    return json_response(err.body(), err.status)


class HangResponse(Response):
    """Never answers; returns when the client goes away."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


class GenerationResponse(Response):
    """Runs one request through the engine and answers as vLLM would."""

    def __init__(
        self,
        engine: Engine,
        req: SimRequest,
        params: p.GenerationParams,
        transfer_params: Callable[[SimRequest], dict[str, Any]],
    ) -> None:
        super().__init__()
        self._engine = engine
        self._transfer_params = transfer_params
        self._req = req
        self._params = params
        self._rid = p.new_id(params.chat)
        self._created = p.now_s()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine, req = self._engine, self._req
        engine.add_request(req)
        if req.done and not self._params.stream:
            await self._send_full(send)  # zero-latency fast path: no watcher task needed
            return
        sender = asyncio.ensure_future(
            self._send_stream(send) if self._params.stream else self._wait_and_send_full(send)
        )
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, watcher):
                task.cancel()
            for task in (sender, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            engine.abort(req)  # no-op once finished; frees blocks of a departed client

    async def _wait_done(self) -> None:
        req = self._req
        while not req.done:
            req.event.clear()
            await req.event.wait()

    async def _wait_and_send_full(self, send: Send) -> None:
        await self._wait_done()
        await self._send_full(send)

    def _usage(self) -> dict[str, Any]:
        req = self._req
        return p.usage(req.num_prompt_tokens, len(req.output), req.num_cached_tokens)

    async def _send_full(self, send: Send) -> None:
        req = self._req
        if req.status is Status.ABORTED:
            err = p.ApiError("The engine is shutting down.", status=503)
            await send_bytes(send, err.status, orjson.dumps(err.body()), JSON)
            return
        kv = None
        params = self._params.kv_transfer_params
        if params and params.get("do_remote_decode"):
            kv = self._transfer_params(req)
        text = self._engine.tokenizer.decode(req.output)
        body = p.full_response(self._params, self._rid, self._created, text, self._usage(), kv)
        await send_bytes(send, 200, orjson.dumps(body), JSON)

    async def _deltas(self) -> AsyncIterator[list[int]]:
        """The output ids generated since the last batch, as they come, until the request is
        done (check ``self._req.status`` after the loop: finished or aborted)."""
        req = self._req
        sent = 0
        while True:
            if sent < len(req.output):
                last = len(req.output)
                yield req.output[sent:last]
                sent = last
            if req.done and sent == len(req.output):
                return
            req.event.clear()
            if sent == len(req.output) and not req.done:
                await req.event.wait()

    async def _send_stream(self, send: Send) -> None:
        req, chat = self._req, self._params.chat
        header = p.chunk_header(self._params, self._rid, self._created)
        piece = self._engine.tokenizer.piece
        await start_event_stream(send)
        tool = self._params.tool_name
        sent = 0
        async for ids in self._deltas():
            out: list[bytes] = []
            if sent == 0 and chat:
                out.append(p.token_chunk(header, True, "", None, role=True))
                if tool is not None:
                    call = p.tool_call(p.new_tool_call_id(), tool, p.ARGS_OPEN)
                    out.append(p.tool_call_chunk(header, call))
            sent += len(ids)
            last = len(ids) - 1
            for i, token in enumerate(ids):
                done = req.status is Status.FINISHED and i == last
                if tool is None:
                    finish = "length" if done else None
                    out.append(p.token_chunk(header, chat, piece(token), finish))
                    continue
                args = p.escape_piece(piece(token)) + (p.ARGS_CLOSE if done else "")
                call = {"function": {"arguments": args}}
                out.append(p.tool_call_chunk(header, call, "tool_calls" if done else None))
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        tail: list[bytes] = []
        if req.status is Status.ABORTED:
            err = p.ApiError("The engine is shutting down.", status=503)
            tail.append(p.sse(err.body()))
        elif self._params.include_usage:
            tail.append(p.sse({**header, "choices": [], "usage": self._usage()}))
        tail.append(p.DONE)
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})


async def start_event_stream(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
            ],
        }
    )


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_bytes(send: Send, status: int, body: bytes, media_type: str) -> None:
    headers = [(b"content-type", media_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
