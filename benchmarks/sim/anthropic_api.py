"""The Anthropic Messages API of a simulated replica (``POST /v1/messages``), as vLLM serves it.

vLLM converts a Messages request into a chat completions request and runs that: ``system``
(string or text blocks, plus any ``system`` messages) becomes the first message, ``tool_use``
blocks become the assistant's ``tool_calls``, each ``tool_result`` block becomes a ``tool``
message placed before the rest of its user message, images become ``image_url`` parts, and
``tools`` become functions. :func:`to_chat_body` does the same, so a conversation sent through
either API is rendered through the same chat template into the same prompt tokens, and shares
the same prefix cache.

The answer is shaped as Anthropic's (``msg_`` ids, content blocks, ``stop_reason``) and usage
follows Anthropic's meaning: ``input_tokens`` are the prompt tokens *not* read from the cache,
``cache_read_input_tokens`` the ones that were. Streams carry the typed events ``message_start``,
``content_block_start``, ``ping``, ``content_block_delta`` (``text_delta`` or
``input_json_delta``), ``content_block_stop``, ``message_delta`` and ``message_stop``; errors
are ``{"type": "error", "error": {"type", "message"}}``, mid-stream as ``event: error``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from . import protocol as p
from .request import Status
from .responses import JSON, GenerationResponse, json_response, send_bytes, start_event_stream

if TYPE_CHECKING:
    from .host import SimHost

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Roles recent Claude Code versions send besides user/assistant (vLLM maps them to user).
_ROLE_ALIASES = {"ctx": "user", "msg": "user"}
# Claude Code's attribution header carries a per-request hash; vLLM drops it from the system
# prompt so that it does not defeat prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: p.ApiError) -> Response:
    return json_response(error_body(err.message, err.status), err.status)


def image_url(source: Any) -> str:
    if not isinstance(source, Mapping):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(body: Mapping[str, Any]) -> str:
    parts: list[str] = []
    sources: list[Any] = [body.get("system")]
    sources += [m.get("content") for m in body["messages"] if m.get("role") == "system"]
    for source in sources:
        if isinstance(source, str):
            parts.append(source)
        elif isinstance(source, list):
            for block in source:
                text = block.get("text") if isinstance(block, Mapping) else None
                if block.get("type") == "text" and text and not text.startswith(BILLING_HEADER):
                    parts.append(text)
    return "".join(parts)


def _tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    images: list[str] = []
    if isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image":
                images.append(image_url(item.get("source")))
        content = "\n".join(texts)
    call_id = str(block.get("tool_use_id") or "")
    out.append({"role": "tool", "tool_call_id": call_id, "content": content or ""})
    if images:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        out.append({"role": "user", "content": parts})


def _message(role: str, blocks: list[Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise p.ApiError("content blocks must be objects", param="messages")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": image_url(block["source"])}})
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                p.tool_call(str(block.get("id") or ""), str(block.get("name") or ""), arguments)
            )
        elif kind == "tool_result":
            if role == "user":
                _tool_result(block, out)
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    message: dict[str, Any] = {"role": role}
    if calls:
        message["tool_calls"] = calls
    if len(parts) == 1:
        message["content"] = parts[0]["text"] if parts[0]["type"] == "text" else parts
    elif parts:
        message["content"] = parts
    # As vLLM: a user message left empty (only tool results) is dropped, an assistant one kept.
    if "content" in message or calls or role != "user":
        out.append(message)


def to_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM runs for a Messages request (validated shape assumed)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body)
    if system:
        out.append({"role": "system", "content": system})
    for message in body["messages"]:
        role = _ROLE_ALIASES.get(message["role"], message["role"])
        if role == "system":
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            _message(role, content, out)
    return out


def to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for tool in tools:
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v}})
    return out


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        return None
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return kind if kind in ("auto", "none") else None


def _validate(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise p.ApiError("messages: Field required (a non-empty list)", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise p.ApiError(f"messages.{i}: an object with a role is required")
        if not isinstance(message.get("content"), (str, list)):
            raise p.ApiError(f"messages.{i}.content: a string or a list of blocks is required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise p.ApiError("max_tokens: Field required (a positive integer)", param="max_tokens")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) and t.get("name") for t in tools)
    ):
        raise p.ApiError("tools: a list of tools with names is required", param="tools")


def to_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body vLLM builds from a Messages body (raises ApiError)."""
    _validate(body)
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": to_chat_messages(body),
        "max_tokens": body["max_tokens"],
        "stream": bool(body.get("stream")),
    }
    tools = to_chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice")) or "auto"
    if body.get("kv_transfer_params") is not None:
        chat["kv_transfer_params"] = body["kv_transfer_params"]
    return chat


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessagesResponse(GenerationResponse):
    """One Messages request through the engine, answered in Anthropic's shapes."""

    def _message(self, content: list[dict[str, Any]], stop: str | None) -> dict[str, Any]:
        req = self._req
        cached = req.num_cached_tokens
        return {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "model": self._params.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": req.num_prompt_tokens - cached,
                "output_tokens": len(req.output),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
            },
        }

    @property
    def _message_id(self) -> str:
        return "msg_" + self._rid.rsplit("-", 1)[-1]

    def _tool_block(self, arguments: Any) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": "toolu_" + uuid.uuid5(uuid.NAMESPACE_OID, self._rid).hex,
            "name": self._params.tool_name,
            "input": arguments,
        }

    async def _send_full(self, send: Send) -> None:
        req = self._req
        if req.status is Status.ABORTED:
            body = error_body("The engine is shutting down.", 529)
            await send_bytes(send, 529, orjson.dumps(body), JSON)
            return
        text = self._engine.tokenizer.decode(req.output)
        if self._params.tool_name is not None:
            content, stop = [self._tool_block({"input": text})], "tool_use"
        else:
            content, stop = [{"type": "text", "text": text}], "max_tokens"
        body = self._message(content, stop)
        kv = self._params.kv_transfer_params
        if kv and kv.get("do_remote_decode"):
            # vLLM's Messages API carries the prefill answer's params, as chat does (Nixl).
            body["kv_transfer_params"] = self._transfer_params(req)
        await send_bytes(send, 200, orjson.dumps(body), JSON)

    async def _send_stream(self, send: Send) -> None:
        req, piece, tool = self._req, self._engine.tokenizer.piece, self._params.tool_name
        await start_event_stream(send)
        sent = 0
        async for ids in self._deltas():
            out: list[bytes] = []
            if sent == 0:
                out.append(
                    _event(
                        "message_start",
                        {"type": "message_start", "message": self._message([], None)},
                    )
                )
                block = self._tool_block({}) if tool else {"type": "text", "text": ""}
                out.append(
                    _event(
                        "content_block_start",
                        {"type": "content_block_start", "index": 0, "content_block": block},
                    )
                )
                out.append(_event("ping", {"type": "ping"}))
            for i, token in enumerate(ids):
                text = piece(token)
                if tool is None:
                    delta = {"type": "text_delta", "text": text}
                else:
                    head = p.ARGS_OPEN if sent == 0 and i == 0 else ""
                    done = req.status is Status.FINISHED and i == len(ids) - 1
                    tail = p.ARGS_CLOSE if done else ""
                    delta = {
                        "type": "input_json_delta",
                        "partial_json": head + p.escape_piece(text) + tail,
                    }
                out.append(
                    _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": 0, "delta": delta},
                    )
                )
            sent += len(ids)
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        await send({"type": "http.response.body", "body": self._tail(), "more_body": False})

    def _tail(self) -> bytes:
        req = self._req
        if req.status is Status.ABORTED:
            body = error_body("The engine is shutting down.", 529)
            return _event("error", body)
        stop = "tool_use" if self._params.tool_name else "max_tokens"
        return b"".join(
            (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop, "stop_sequence": None},
                        "usage": {"output_tokens": len(req.output)},
                    },
                ),
                _event("message_stop", {"type": "message_stop"}),
            )
        )


async def handle(sim: SimHost, request: Request) -> Response:
    """``POST /v1/messages``."""
    fault = await sim.injected_fault()
    if fault is not None:
        return fault if isinstance(fault, Response) else error_response(fault)
    try:
        body = p.parse_json(await request.body())
        chat = to_chat_body(body)
        params = p.parse_generation(chat, sim.config, sim.engine.tokenizer, chat=True)
    except p.ApiError as err:
        return error_response(err)
    too_big = sim.capacity_error(params)
    if too_big is not None:
        return error_response(too_big)
    return MessagesResponse(sim.engine, sim.new_request(params), params, sim.transfer_params)


async def count_tokens(sim: SimHost, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``/v1/messages`` counts them."""
    try:
        body = p.parse_json(await request.body())
        ids = p.chat_prompt_ids(to_chat_body({**body, "max_tokens": 1}), sim.engine.tokenizer)
    except p.ApiError as err:
        return error_response(err)
    return Response(orjson.dumps({"input_tokens": len(ids)}), media_type="application/json")
