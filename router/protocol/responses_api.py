"""The OpenAI Responses API (``/v1/responses``) at the gateway: validation, the canonical
rendering the prefix index hashes, and the requests that must reach one particular endpoint.

vLLM serves a Responses request as chat messages: ``instructions`` first as a system message,
then ``input`` (a string is one user message; ``message`` items are messages,
``function_call`` items the assistant's ``tool_calls``, ``function_call_output`` items ``tool``
messages), through the model's chat template. :func:`to_chat` converts the same way and
:func:`render_responses` renders with :func:`router.protocol.rendering.render_chat`, so a
conversation
hashes alike through chat completions, Messages or Responses, and a client resending its whole
history every turn (Codex does, with ``store: false``) hashes to a growing chain.

With ``previous_response_id`` the history is on the replica that stored the previous response:
the router pins the request there (:mod:`router.index.response_store`), and ``GET``/``DELETE
/v1/responses/{id}`` and ``POST .../cancel`` go there too (:mod:`router.api.stored_responses`).
``prompt_cache_key``, OpenAI's key for "requests that share a prefix", is the session key when
no ``x-session-id`` header is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router.core.errors import BadRequestError
from router.index.response_store import RESPONSE_ID
from router.protocol.rendering import render_conversation

_TEXT_PARTS = ("input_text", "output_text", "text")


def stream_error_event(message: str, error_type: str = "upstream_error", code: int = 502) -> bytes:
    """A mid-stream error as the Responses API sends it: a typed ``error`` event."""
    data = {
        "type": "error",
        "code": error_type,
        "message": message,
        "param": None,
        "sequence_number": 0,
    }
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


# -- validation ---------------------------------------------------------------------------------


def _optional(payload: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise BadRequestError(f"'{key}' must be {what}", param=key)
    return value


def _check(payload: Mapping[str, Any]) -> None:
    items = payload.get("input")
    if not isinstance(items, (str, list)):
        raise BadRequestError("'input' must be a string or an array of items", param="input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise BadRequestError(f"input[{i}] must be an object", param=f"input[{i}]")
    _optional(payload, "instructions", str, "a string")
    _optional(payload, "tools", list, "an array")
    _optional(payload, "prompt_cache_key", str, "a string")
    _optional(payload, "store", bool, "a boolean")
    _optional(payload, "background", bool, "a boolean")
    previous = _optional(payload, "previous_response_id", str, "a response id")
    if previous is not None and not RESPONSE_ID.fullmatch(previous):
        raise BadRequestError(
            "'previous_response_id' is not a valid response id", param="previous_response_id"
        )
    limit = payload.get("max_output_tokens")
    if limit is not None and (
        isinstance(limit, bool)
        or not isinstance(limit, (int, float))
        or limit < 1
        or not float(limit).is_integer()
    ):
        raise BadRequestError(
            "'max_output_tokens' must be a positive integer", param="max_output_tokens"
        )
    tools = payload.get("tools") or []
    if not all(isinstance(t, Mapping) for t in tools):
        raise BadRequestError("'tools' must be an array of objects", param="tools")


# -- conversion to chat messages (vLLM's) and rendering -------------------------------------------


def _parts(content: list[Any]) -> list[Any]:
    parts: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url") or part.get("file_id") or ""
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append(part)
    return parts


def _content(value: Any) -> Any:
    return _parts(value) if isinstance(value, list) else value


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A reasoning item's text as vLLM takes it: its content's first part, else its summary's."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts:
            text = parts[0].get("text") if isinstance(parts[0], Mapping) else None
            return text if isinstance(text, str) else ""
    return ""


def _assistant(out: list[dict[str, Any]]) -> dict[str, Any] | None:
    last = out[-1] if out else None
    return last if last is not None and last.get("role") == "assistant" else None


def _item(item: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    kind = item.get("type", "message")
    prev = _assistant(out)
    if kind == "message":
        role = item.get("role")
        content = _content(item.get("content"))
        if role == "assistant" and prev is not None and prev.get("content") is None:
            prev["content"] = content  # vLLM merges it into a tool-call or reasoning turn
        else:
            out.append({"role": role if isinstance(role, str) else "", "content": content})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if prev is not None:
            calls = prev.setdefault("tool_calls", [])
            if isinstance(calls, list):
                calls.append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append(
            {
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": _content(item.get("output")),
            }
        )
    elif kind == "reasoning":
        # As vLLM: the assistant's reasoning, which the chat template renders (the rendering
        # leaves it out); a second one in a row is not carried.
        text = _reasoning_text(item)
        if prev is None:
            out.append({"role": "assistant", "content": None, "reasoning": text})
        elif prev.get("reasoning") is None:
            prev["reasoning"] = text
    else:
        # Item kinds vLLM does not convert still render deterministically, in order.
        out.append(
            {"role": str(kind), "content": orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode()}
        )


def _tools(tools: Any) -> list[Any] | None:
    if not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        if tool.get("type") != "function":
            out.append(tool)
            continue
        function = {k: tool.get(k) for k in ("name", "description", "parameters")}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v}})
    return out


def to_chat(payload: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """The chat messages and tools vLLM runs for a (validated) Responses body, without the
    history a ``previous_response_id`` adds on the replica."""
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = payload["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        for item in items:
            _item(item, messages)
    return messages, _tools(payload.get("tools"))


def render_responses(payload: Mapping[str, Any]) -> tuple[str, tuple[int, int] | None]:
    """Validate a Responses body (400 naming the field) and render it for the prefix index
    (with the span of its last answer: :func:`router.protocol.rendering.render_conversation`)."""
    _check(payload)
    messages, tools = to_chat(payload)
    return render_conversation(messages, tools)


def session_hint(payload: Mapping[str, Any]) -> str | None:
    key = payload.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


# A Responses stream's events sent before the model has produced anything: vLLM sends the
# first two as soon as the request is accepted (and the simulator the rest of these too).
_OPENING_EVENTS = frozenset((
    b"response.created", b"response.in_progress", b"response.queued",
    b"response.output_item.added", b"response.content_part.added",
))


_FAILED_EVENTS = frozenset((b"error", b"response.failed", b"response.incomplete"))
# Without event lines: the types that mean a token, or the end.
_TOKEN_TYPES = (b'.delta"', b'"type":"response.completed"', b'"type": "response.completed"')
_FAILED_TYPES = (b'"type":"error"', b'"type": "error"', b'"type":"response.failed"',
                 b'"type": "response.failed"')

OPENING, TOKEN, FAILED = 0, 1, 2


def opening(chunk: bytes) -> bool:
    """The chunk holds nothing past the stream's opening events (see :func:`answer_begun`)."""
    return answer_begun(chunk) == OPENING


def answer_begun(chunk: bytes) -> int:
    """How far a chunk of a Responses stream has got past its opening events: OPENING (not
    yet), TOKEN (a first token, or the end) or FAILED (an error before any token). The time
    to TOKEN, not to the first byte, is the time to first token. Only whole ``event:`` lines
    count (a chunk may end inside one)."""
    lines = chunk.split(b"\n")[:-1]  # the last is unfinished (or empty)
    names = [line[6:].strip() for line in lines if line.startswith(b"event:")]
    if not names:  # a stream without event lines: its events' types, roughly
        if any(t in chunk for t in _TOKEN_TYPES):
            return TOKEN
        return FAILED if any(t in chunk for t in _FAILED_TYPES) else OPENING
    later = [name for name in names if name not in _OPENING_EVENTS]
    if not later:
        return OPENING
    return FAILED if all(name in _FAILED_EVENTS for name in later) else TOKEN
