"""The Anthropic Messages API (``POST /v1/messages``) at the gateway: validation, the canonical
rendering the prefix index hashes, and the Anthropic error shape.

vLLM serves this API by converting a Messages request into a chat completions request
(``system`` becomes the first message, ``tool_use`` blocks the assistant's ``tool_calls``, each
``tool_result`` a ``tool`` message placed before the rest of its user message, ``tools``
functions) and running that through the model's chat template. :func:`to_chat` does the same
conversion and :func:`render_messages` renders the result with
:func:`router.protocol.rendering.render_chat`,
so a conversation hashes to the same blocks whichever of the two APIs carries it, and a session
growing turn by turn hashes to a growing chain. What vLLM drops, the rendering drops too:
``cache_control`` markers (Claude Code moves them every turn, which would break the chain at the
marker) and Claude Code's per-request billing header in ``system``. Thinking blocks become the
assistant's ``reasoning``, as vLLM's conversion makes them (the chat template renders it, so
precise routing tokenizes it), but the rendering leaves them out.

Errors on this endpoint take Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``; a request shed by flow control is answered ``529 overloaded_error`` (Anthropic's
status for "try again later", which its SDKs retry). Mid-stream errors are an ``event: error``,
since Anthropic clients ignore SSE events without an event name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

from router.core.errors import BadRequestError, GatewayError, SaturatedError
from router.protocol.rendering import render_conversation

OVERLOADED = 529
# vLLM accepts these roles (recent Claude Code versions send ctx and msg; vLLM maps them to user).
_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "ctx": "user",
    "msg": "user",
}
_TOOL_CHOICES = ("auto", "any", "tool", "none")
# Claude Code's attribution header carries a per-request hash; vLLM drops it from the system
# prompt so that it does not defeat prefix caching, and so must the rendering.
BILLING_HEADER = "x-anthropic-billing-header"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    # No endpoint, or shutting down: a try-again-later, as Anthropic says overloaded.
    503: "overloaded_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}


def error_kind(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(message: str, status: int) -> bytes:
    return orjson.dumps(
        {"type": "error", "error": {"type": error_kind(status), "message": message}}
    )


def error_status(error: GatewayError) -> int:
    return OVERLOADED if isinstance(error, SaturatedError) else error.status_code


def error_response(error: GatewayError) -> Response:
    """A gateway error in Anthropic's shape, with the same headers (retry-after, dropped reason)."""
    status = error_status(error)
    return Response(
        error_body(error.message, status),
        status,
        dict(error.headers()),
        media_type="application/json",
    )


def stream_error_event(message: str, error_type: str = "api_error", code: int = 502) -> bytes:
    """A mid-stream error as Anthropic sends it (the relay puts it after a complete event);
    the type follows from ``code``, Anthropic's types being other than OpenAI's."""
    return b"event: error\ndata: " + error_body(message, code) + b"\n\n"


# -- validation ---------------------------------------------------------------------------------


def _blocks(value: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise BadRequestError(
            f"{where} must be a string or an array of content blocks", param=where
        )
    for i, block in enumerate(value):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise BadRequestError(
                f"{where}[{i}] must be an object with a string 'type'", param=f"{where}[{i}]"
            )
    return value


def _check_messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise BadRequestError(
                f"{where} must be an object whose role is 'user' or 'assistant'", param=where
            )
        if not isinstance(message.get("content"), str):
            _blocks(message.get("content"), f"{where}.content")
    return messages


def _check_fields(payload: Mapping[str, Any]) -> None:
    max_tokens = payload.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequestError("'max_tokens' is required: a positive integer", param="max_tokens")
    system = payload.get("system")
    if system is not None and not isinstance(system, str):
        _blocks(system, "system")
    tools = payload.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, Mapping) and isinstance(t.get("name"), str) for t in tools)
    ):
        raise BadRequestError("'tools' must be an array of tools with a 'name'", param="tools")
    choice = payload.get("tool_choice")
    if choice is not None and not (
        isinstance(choice, Mapping) and choice.get("type") in _TOOL_CHOICES
    ):
        raise BadRequestError(
            "'tool_choice' must be an object whose type is auto, any, tool or none",
            param="tool_choice",
        )
    metadata = payload.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), (str, type(None)))
    ):
        raise BadRequestError(
            "'metadata' must be an object; its user_id a string", param="metadata"
        )


# -- conversion to chat messages (vLLM's) and rendering -------------------------------------------


def _image_url(source: Any) -> str:
    if not isinstance(source, Mapping):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(payload: Mapping[str, Any]) -> str:
    sources: list[Any] = [payload.get("system")]
    sources += [m.get("content") for m in payload["messages"] if m.get("role") == "system"]
    parts: list[str] = []
    for source in sources:
        if isinstance(source, str):
            parts.append(source)
        elif isinstance(source, list):
            for block in source:
                text = block.get("text")
                if block.get("type") != "text" or not isinstance(text, str):
                    continue
                if text and not text.startswith(BILLING_HEADER):
                    parts.append(text)
    return "".join(parts)


def _tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    images: list[str] = []
    if isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if isinstance(item, Mapping) and item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif isinstance(item, Mapping) and item.get("type") == "image":
                images.append(_image_url(item.get("source")))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        content = ""
    out.append(
        {"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": content}
    )
    if images:
        out.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": u}} for u in images],
            }
        )


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    # In the client's key order, as vLLM's json.dumps writes them: the chat template renders
    # the arguments in their order, so sorted ones would not tokenize as the engine's prompt.
    arguments = orjson.dumps(block.get("input") or {}).decode()
    name = block.get("name")
    function = {"name": name if isinstance(name, str) else "", "arguments": arguments}
    return {"id": str(block.get("id") or ""), "type": "function", "function": function}


def _convert(role: str, blocks: list[Mapping[str, Any]], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "tool_use":
            calls.append(_tool_call(block))
        elif kind == "tool_result" and role == "user":
            _tool_result(block, out)
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    message: dict[str, Any] = {"role": role}
    if reasoning:  # as vLLM: the template's to render (the index's rendering leaves it out)
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        message["content"] = parts
    # As vLLM: a user message left empty (only tool results) is dropped, an assistant one kept.
    if parts or calls or role != "user":
        out.append(message)


def to_chat(payload: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The chat messages and tools vLLM runs for a (validated) Messages body."""
    messages: list[dict[str, Any]] = []
    system = _system_text(payload)
    if system:
        messages.append({"role": "system", "content": system})
    for message in payload["messages"]:
        role = _ROLES[message["role"]]
        if role == "system":
            continue
        content = message["content"]
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        else:
            _convert(role, content, messages)
    return messages, _tools(payload.get("tools"))


def _tools(tools: Any) -> list[Any] | None:
    if not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        if "input_schema" not in tool:
            # A server tool (web search, bash...): rendered as sent, less its cache marker.
            out.append({k: v for k, v in tool.items() if k != "cache_control"})
            continue
        function = {k: tool.get(k) for k in ("name", "description")}
        function["parameters"] = tool.get("input_schema")
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v}})
    return out


def session_hint(payload: Mapping[str, Any]) -> str | None:
    """``metadata.user_id``, the only per-conversation key a Messages client sends.

    Claude Code fills it with ``user_<hash>_account_<uuid>_session_<uuid>``, one value per
    session (its sub-agents share it, and their prompts share the parent's system prompt and
    tools). A client that sets it per user groups that user's conversations instead, which the
    affinity scorer weighs against load like any session.
    """
    metadata = payload.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    return user_id if isinstance(user_id, str) and user_id else None


def render_messages(payload: Mapping[str, Any]) -> tuple[str, tuple[int, int] | None]:
    """Validate a Messages body (400 naming the field) and render it for the prefix index
    (with the span of its last answer: :func:`router.protocol.rendering.render_conversation`)."""
    _check_messages(payload)
    _check_fields(payload)
    messages, tools = to_chat(payload)
    return render_conversation(messages, tools)
